"""Per-step metrics to JSONL (the source of truth for reports) and TensorBoard event files.

JSONL line: ``{"step": int, "wall_time": float, "scalars": {name: float}, "histograms": {name: [..]}}``.
:func:`read_metrics` gives a run directory's records, local or gs://, in the order they were logged.

A local run directory holds one ``metrics.jsonl``, appended and flushed per step (``tail -f`` it).

A gs:// run directory cannot append to an object, and rewriting one file per step uploads
O(n^2) bytes over a run. It holds immutable objects under ``metrics/`` instead, never rewritten:
* each record is uploaded as its own object when it is logged, ``<epoch>-<seq>-<seq>.jsonl``.
  Per record, not buffered: a snapshot is taken every step, and a resume redoes only the steps
  after it, so a record buffered across a snapshot and lost with the process would never be
  logged again;
* every ``SEGMENT_RECORDS`` records (and at close) those are uploaded again as one segment,
  ``<epoch>-<first>-<last>.jsonl``, and the single-record objects deleted, so a run keeps about
  n / SEGMENT_RECORDS objects to read. Each record is uploaded twice: O(n) bytes. A crash between
  the segment and the deletes leaves both; the reader takes the widest object covering a range;
* each writer (each process that logs into the run directory) is a new ``epoch``. On resume,
  ``MetricsWriter(..., resume_after_step=s)`` first writes ``<epoch>-resume.json`` holding s: the
  reader drops the earlier epochs' records of steps > s (logged by the crashed run after its last
  snapshot, and logged again now), so a step is never read twice.
A ``metrics.jsonl`` on gs:// (written before the segments) is read as the first epoch.

Every record also goes to the run's sinks (``observability.sinks``: TensorBoard, Weights &
Biases, a plugin's; rlax_tpu/observability/sinks.py), each on a thread of its own: a sink that
fails is dropped with a warning and never stops the run.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu import storage
from rlax_tpu.config import RunConfig
from rlax_tpu.observability import sinks as sinks_lib

METRICS_FILE = "metrics.jsonl"  # a local run directory's metrics
SEGMENTS_DIR = "metrics"  # a remote run directory's metrics objects
# Records per segment: a finished run's segments are ~n/100 objects of at most a few hundred KB,
# and a crashed one leaves at most 99 single-record objects per epoch besides.
SEGMENT_RECORDS = 100
_IO_THREADS = 16  # parallel object reads and deletes (each a round trip to GCS)
_OBJECT = re.compile(r"^(\d{6})-(?:(\d{9})-(\d{9})\.jsonl|resume\.json)$")

log = logging.getLogger(__name__)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _object_name(epoch: int, first: int, last: int) -> str:
    return f"{epoch:06d}-{first:09d}-{last:09d}.jsonl"


def _resume_name(epoch: int) -> str:
    return f"{epoch:06d}-resume.json"


class _SegmentLog:
    """The writing side of a remote run directory's ``metrics/`` (see the module docstring)."""

    def __init__(self, directory: storage.epath.Path, resume_after_step: int | None):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.epoch = 1 + max((o.epoch for o in _list_objects(self.dir)), default=-1)
        self.seq = 0  # records this epoch has logged
        self._pending: list[str] = []  # lines since the last segment, each its own object
        if resume_after_step is not None:
            storage.write_atomic(
                self.dir / _resume_name(self.epoch),
                json.dumps({"after_step": int(resume_after_step)}),
            )

    def append(self, line: str) -> bool:
        """Uploads one record; True when that completed a segment."""
        storage.write_atomic(self.dir / _object_name(self.epoch, self.seq, self.seq), line)
        self._pending.append(line)
        self.seq += 1
        if len(self._pending) < SEGMENT_RECORDS:
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """The pending records as one segment; their single-record objects deleted after it."""
        pending, self._pending = self._pending, []
        if len(pending) < 2:
            return
        first = self.seq - len(pending)
        storage.write_atomic(
            self.dir / _object_name(self.epoch, first, self.seq - 1), "".join(pending)
        )
        singles = [self.dir / _object_name(self.epoch, i, i) for i in range(first, self.seq)]
        with cf.ThreadPoolExecutor(_IO_THREADS) as pool:
            list(pool.map(lambda p: p.unlink(missing_ok=True), singles))


class MetricsWriter:
    """metrics.jsonl (local) or ``metrics/`` segments (gs://), and the run's sinks.

    ``sinks``: names of sinks (built-in or registered, see sinks.py), opened with ``config``
    (its defaults when None)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume_after_step: int | None = None,
        sinks: Sequence[str] = ("tensorboard",),
        config: RunConfig | None = None,
    ):
        self.run_dir = storage.path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._segments: _SegmentLog | None = None
        self._jsonl = None
        if storage.is_remote(self.run_dir):
            self._segments = _SegmentLog(self.run_dir / SEGMENTS_DIR, resume_after_step)
        else:
            path = self.run_dir / METRICS_FILE
            if path.exists() and resume_after_step is not None:  # once per resume
                kept = [r for r in _read_file(path) if r["step"] <= resume_after_step]
                storage.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self.sinks = open_sinks(sinks, self.run_dir, config, resume_after_step)
        self._closed = False

    def write(
        self,
        step: int,
        scalars: Mapping[str, float],
        histograms: Mapping[str, Sequence[float]] | None = None,
        *,
        wall_time: float | None = None,
    ) -> None:
        """Logs one step. Non-finite scalars are stored as null in JSONL (sinks skip them)."""
        wall_time = time.time() if wall_time is None else wall_time
        histograms = histograms or {}
        record = {
            "step": int(step),
            "wall_time": wall_time,
            "scalars": {k: _finite_or_none(float(v)) for k, v in scalars.items()},
            "histograms": {k: [float(x) for x in v] for k, v in histograms.items()},
        }
        line = json.dumps(record) + "\n"
        if self._segments is not None:
            self._segments.append(line)
        else:
            self._jsonl.write(line)
            self._jsonl.flush()
        finite = {k: v for k, v in record["scalars"].items() if v is not None}
        for sink in self.sinks:
            sink.submit("log", int(step), wall_time, finite, record["histograms"])

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table (rows of dicts) to the sinks that show tables."""
        rows = [dict(r) for r in rows]
        for sink in self.sinks:
            sink.submit("table", int(step), name, rows)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        else:
            self._segments.compact()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_sinks(
    names: Sequence[str],
    run_dir: storage.epath.Path,
    config: RunConfig | None,
    resume_after_step: int | None,
) -> list[sinks_lib.GuardedSink]:
    """The sinks ``names``, each opening on a thread of its own."""
    context = sinks_lib.SinkContext(run_dir, config or RunConfig(), resume_after_step)
    out = []
    for name in names:
        factory = _factory(name)
        out.append(sinks_lib.GuardedSink(name, lambda factory=factory: factory(context)))
    return out


def _factory(name: str) -> sinks_lib.SinkFactory:
    # Imported on use: W&B's client costs its import only in runs that log to it.
    if name == "tensorboard":
        from rlax_tpu.observability.tensorboard import TensorBoardSink

        return TensorBoardSink
    if name == "wandb":
        from rlax_tpu.observability.wandb_sink import WandbSink

        return WandbSink
    factory = sinks_lib.registered(name)
    if factory is None:
        known = ["tensorboard", "wandb", *sinks_lib.registered_names()]
        raise ValueError(f"unknown metric sink {name!r}; known: {known}")
    return factory


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record a run directory (local or gs://) holds, in the order logged; [] for none.
    A torn last line of a file (a crash mid-write) is ignored; corruption elsewhere raises."""
    run_dir = storage.path(run_dir)
    legacy = run_dir / METRICS_FILE
    records = _read_file(legacy) if legacy.exists() else []
    if not storage.is_remote(run_dir):
        return records
    directory = run_dir / SEGMENTS_DIR
    objects = _list_objects(directory)
    plan: list[tuple[_Object, int]] = []  # (object, records of it to skip), in order
    for epoch in sorted({o.epoch for o in objects}):
        mine = [o for o in objects if o.epoch == epoch]
        plan += [(o, 0) for o in mine if o.first < 0]  # the resume marker first
        # Widest first among those starting alike; an object inside the ones taken is a
        # single-record leftover of a segment (a crash before its deletes).
        covered = 0
        for o in sorted((o for o in mine if o.first >= 0), key=lambda o: (o.first, -o.last)):
            if o.last < covered:
                continue
            if o.first > covered:
                log.warning(
                    "%s: records %d-%d of epoch %d are missing",
                    directory,
                    covered,
                    o.first - 1,
                    epoch,
                )
            plan.append((o, max(0, covered - o.first)))
            covered = o.last + 1
    with cf.ThreadPoolExecutor(_IO_THREADS) as pool:
        texts = list(pool.map(lambda item: item[0].path.read_text(encoding="utf-8"), plan))
    for (o, skip), text in zip(plan, texts, strict=True):
        if o.first < 0:
            after = int(json.loads(text)["after_step"])
            records = [r for r in records if r["step"] <= after]
        else:
            records += _parse_lines(text, o.path)[skip:]
    return records


@dataclasses.dataclass(frozen=True)
class _Object:
    path: storage.epath.Path
    epoch: int
    first: int  # -1 for a resume marker
    last: int


def _list_objects(directory: storage.epath.Path) -> list[_Object]:
    out = []
    if not directory.exists():
        return out
    for p in directory.iterdir():
        if m := _OBJECT.match(p.name):
            first, last = (int(m.group(2)), int(m.group(3))) if m.group(2) else (-1, -1)
            out.append(_Object(p, int(m.group(1)), first, last))
    return out


def _read_file(path: storage.epath.Path) -> list[dict[str, Any]]:
    return _parse_lines(path.read_text(encoding="utf-8"), path)


def _parse_lines(text: str, path: object) -> list[dict[str, Any]]:
    lines = text.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return out
