from __future__ import annotations

import io

from rlax_tpu.observability.progress import Progress, format_duration


class FakeClock:
    """A controllable clock (the real one would make the ETA text time-dependent)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(10, fields={"reward": ".2f", "tok/s": ".0f"}, stream=out, clock=clock)
    clock.now = 30.0
    p.update(3, {"reward": 0.256, "tok/s": 1234.4})
    assert out.getvalue() == "step 3/10 | reward 0.26 | tok/s 1234 | elapsed 30s | eta 1m10s\n"


def test_live_line_on_a_terminal_is_rewritten_in_place():
    clock, out = FakeClock(), Tty()
    p = Progress(4, fields={"reward": ".1f"}, stream=out, clock=clock)
    clock.now = 10.0
    p.update(1, {"reward": 0.5})
    p.message("eval pass@1 0.40")
    clock.now = 20.0
    p.update(2, {"reward": 0.75})
    p.close()
    text = out.getvalue()
    assert text.startswith("\rstep 1/4 | reward 0.5 | elapsed 10s | eta 30s")
    assert "eval pass@1 0.40\n" in text
    assert text.endswith("\rstep 2/4 | reward 0.8 | elapsed 20s | eta 20s\n")


def test_resumed_runs_estimate_from_their_own_steps():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(100, fields={}, stream=out, clock=clock, start_step=90)
    clock.now = 5.0
    p.update(91, {})
    assert out.getvalue().strip().endswith("eta 45s")


def test_format_duration():
    assert [format_duration(s) for s in (0, 59, 61, 3600 + 62)] == [
        "0s",
        "59s",
        "1m01s",
        "1h01m02s",
    ]
