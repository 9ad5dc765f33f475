"""Progress display: one live status line on a terminal, plain log lines otherwise."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from typing import TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Shows ``step i/n`` with chosen fields and an ETA from the mean step time so far.

    ``fields`` maps a display name to a format spec, e.g. {"reward": ".3f", "tok/s": ".0f"}.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        fields: Mapping[str, str],
        stream: TextIO | None = None,
        start_step: int = 0,
        clock=time.monotonic,
    ):
        self.total, self.fields = total_steps, dict(fields)
        self.stream = stream or sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._start_time, self._start_step = clock(), start_step
        self._last_len = 0

    def line(self, step: int, values: Mapping[str, float]) -> str:
        done = step - self._start_step
        elapsed = self._clock() - self._start_time
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        parts = [f"step {step}/{self.total}"]
        for name, spec in self.fields.items():
            if name in values:
                parts.append(f"{name} {values[name]:{spec}}")
        parts.append(f"elapsed {format_duration(elapsed)}")
        if eta == eta:  # not NaN
            parts.append(f"eta {format_duration(eta)}")
        return " | ".join(parts)

    def update(self, step: int, values: Mapping[str, float]) -> None:
        text = self.line(step, values)
        if self.live:
            width = shutil.get_terminal_size((120, 20)).columns - 1
            text = text[:width]
            self.stream.write("\r" + text + " " * max(0, self._last_len - len(text)))
            self._last_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that stays (warnings, evaluations) without breaking the live line."""
        if self.live and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
