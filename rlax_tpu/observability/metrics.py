"""Per-step metrics to JSONL (the source of truth for reports) and TensorBoard event files.

JSONL line: ``{"step": int, "wall_time": float, "scalars": {name: float}, "histograms": {name: [..]}}``.
Writes are appended and flushed per step, so a preempted run keeps everything it logged (a gs://
run directory, whose objects cannot be appended to, gets the whole file rewritten per step: one
object upload, never half a line). On resume,
``MetricsWriter(..., resume_after_step=s)`` drops lines of steps > s that the crashed run wrote
after its last snapshot, so a step is never logged twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from rlax_tpu import storage

METRICS_FILE = "metrics.jsonl"


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, resume_after_step: int | None = None):
        self.run_dir = storage.path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._remote = storage.is_remote(self.run_dir)
        self._lines: list[str] = []  # a remote file's contents, rewritten per write
        if self.path.exists() and (resume_after_step is not None or self._remote):
            kept = [
                r
                for r in read_metrics(self.path)
                if resume_after_step is None or r["step"] <= resume_after_step
            ]
            self._lines = [json.dumps(r) + "\n" for r in kept]
            storage.write_atomic(self.path, "".join(self._lines))
        self._jsonl = None if self._remote else open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._tb = EventFileWriter(os.fspath(self.run_dir / "tensorboard"))

    def write(
        self,
        step: int,
        scalars: Mapping[str, float],
        histograms: Mapping[str, Sequence[float]] | None = None,
        *,
        wall_time: float | None = None,
    ) -> None:
        """Logs one step. Non-finite scalars are stored as null in JSONL (and skipped in TB)."""
        wall_time = time.time() if wall_time is None else wall_time
        histograms = histograms or {}
        record = {
            "step": int(step),
            "wall_time": wall_time,
            "scalars": {k: _finite_or_none(float(v)) for k, v in scalars.items()},
            "histograms": {k: [float(x) for x in v] for k, v in histograms.items()},
        }
        line = json.dumps(record) + "\n"
        if self._jsonl is None:
            self._lines.append(line)
            storage.write_atomic(self.path, "".join(self._lines))
        else:
            self._jsonl.write(line)
            self._jsonl.flush()
        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=float(v))
            for k, v in scalars.items()
            if math.isfinite(float(v))
        ]
        values += [
            summary_pb2.Summary.Value(tag=k, histo=_histogram(v))
            for k, v in histograms.items()
            if len(v)
        ]
        event = event_pb2.Event(
            wall_time=wall_time, step=int(step), summary=summary_pb2.Summary(value=values)
        )
        self._tb.add_event(event)
        self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _histogram(values: Sequence[float]) -> summary_pb2.HistogramProto:
    v = np.asarray(values, dtype=np.float64)
    edges = np.histogram_bin_edges(v, bins=min(30, max(1, len(np.unique(v)))))
    counts, edges = np.histogram(v, bins=edges)
    return summary_pb2.HistogramProto(
        min=float(v.min()),
        max=float(v.max()),
        num=float(v.size),
        sum=float(v.sum()),
        sum_squares=float((v * v).sum()),
        bucket_limit=[float(e) for e in edges[1:]],
        bucket=[float(c) for c in counts],
    )


def read_metrics(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a crash mid-write) is ignored."""
    lines = storage.path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    for i, line in enumerate(lines):
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
