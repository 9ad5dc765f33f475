"""Metric sinks of a user's own, as a plugin module (``--config.algorithm.plugins=
'("tests.observability.plugin_sinks",)'``): one that records what it gets in the run directory,
one that raises on its second record, one that cannot open."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tpu.observability.sinks import SinkContext, register_sink

RECORDED = "recorded_sink.jsonl"  # in the run directory


class Recording:
    def __init__(self, context: SinkContext):
        self._file = open(context.run_dir / RECORDED, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, step: int, wall_time: float, scalars: Mapping, histograms: Mapping) -> None:
        line = {"step": step, "scalars": dict(scalars), "histograms": dict(histograms)}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        self._file.write(json.dumps({"step": step, "table": name, "rows": list(rows)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Exploding:
    def __init__(self, context: SinkContext):
        self.records = 0

    def log(self, step: int, wall_time: float, scalars: Mapping, histograms: Mapping) -> None:
        self.records += 1
        if self.records == 2:
            raise ConnectionError("the sink's server went away")

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def cannot_open(context: SinkContext) -> Recording:
    raise PermissionError(f"bad credentials for {context.run_dir.name}")


register_sink("recording", Recording)
register_sink("exploding", Exploding)
register_sink("unopenable", cannot_open)
