"""The TensorBoard sink: event files under ``<run_dir>/tensorboard``.

Local directories are appended and flushed per record. On gs:// (where TensorBoard's file layer
"appends" by overwriting the object with the new bytes alone) the events of every
``SEGMENT_RECORDS`` records go into one new event file: a crash loses at most the last
SEGMENT_RECORDS - 1 records' events there (metrics.jsonl keeps everything).
"""

from __future__ import annotations

import io
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

from rlax_tpu import storage
from rlax_tpu.observability.sinks import SinkContext, bins

# Records per event file on gs:// (the cadence of metrics.jsonl's segments there).
SEGMENT_RECORDS = 100


class _EventSegments:
    """TensorBoard events for a remote directory: buffered, then one new event file per
    :meth:`flush` (files named by time, so TensorBoard reads them in order)."""

    def __init__(self, directory: storage.epath.Path):
        self.dir = directory
        self._buf = io.BytesIO()
        self._records = RecordWriter(self._buf)
        self._files = 0

    def add_event(self, event: event_pb2.Event) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        if not self._buf.tell():
            return
        head = io.BytesIO()
        version = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
        RecordWriter(head).write(version.SerializeToString())
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
            f".{os.getpid()}.{self._files:06d}"
        )
        storage.write_atomic(self.dir / name, head.getvalue() + self._buf.getvalue())
        self._files += 1
        self._buf.seek(0)
        self._buf.truncate()

    def close(self) -> None:
        self.flush()


class TensorBoardSink:
    def __init__(self, context: SinkContext):
        directory = context.run_dir / "tensorboard"
        self._remote = storage.is_remote(directory)
        self._records = 0
        self._writer: EventFileWriter | _EventSegments
        if self._remote:
            directory.mkdir(parents=True, exist_ok=True)
            self._writer = _EventSegments(directory)
        else:
            self._writer = EventFileWriter(os.fspath(directory))

    def log(
        self,
        step: int,
        wall_time: float,
        scalars: Mapping[str, float],
        histograms: Mapping[str, Sequence[float]],
    ) -> None:
        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=float(v))
            for k, v in scalars.items()
            if math.isfinite(float(v))
        ]
        values += [
            summary_pb2.Summary.Value(tag=k, histo=histogram(v))
            for k, v in histograms.items()
            if len(v)
        ]
        self._writer.add_event(
            event_pb2.Event(
                wall_time=wall_time, step=int(step), summary=summary_pb2.Summary(value=values)
            )
        )
        self._records += 1
        if not self._remote or self._records % SEGMENT_RECORDS == 0:
            self._writer.flush()

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        del step, name, rows  # TensorBoard has no tables; the run directory keeps them

    def close(self) -> None:
        self._writer.close()


def histogram(values: Sequence[float]) -> summary_pb2.HistogramProto:
    """TensorBoard's histogram of ``values``: up to 30 equal-width buckets."""
    v = np.asarray(values, dtype=np.float64)
    counts, edges = bins(v)
    return summary_pb2.HistogramProto(
        min=float(v.min()),
        max=float(v.max()),
        num=float(v.size),
        sum=float(v.sum()),
        sum_squares=float((v * v).sum()),
        bucket_limit=[float(e) for e in edges[1:]],
        bucket=[float(c) for c in counts],
    )
