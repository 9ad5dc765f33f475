"""Metric sinks: where a run's steps go besides metrics.jsonl (TensorBoard, Weights & Biases, or
one a plugin registers).

A sink receives every record the run logs (``log``: a step's scalars and histograms) and tables
(``table``: rows of dicts, e.g. an evaluation's answers), in order, on a thread of its own: a slow
one (an upload, W&B's wait for its server) never holds the controller, and one that raises is
dropped with one warning while the run and the other sinks go on. metrics.jsonl is written by
the :class:`~rlax_tpu.observability.metrics.MetricsWriter` itself and is the record reports and
resumes read.

A plugin (a module named in ``algorithm.plugins``) adds one with :func:`register_sink`::

    def open_my_sink(context: SinkContext) -> Sink: ...
    register_sink("my_sink", open_my_sink)   # then observability.sinks=("tensorboard", "my_sink")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from rlax_tpu import storage
from rlax_tpu.config import RunConfig, register_sink_name

log = logging.getLogger(__name__)

# Records a sink may lag behind before the newest are dropped (with a warning): hours of steps,
# so only a sink that stopped making progress reaches it.
QUEUE_RECORDS = 10_000
# How long closing waits for a sink to take what it was given (W&B's upload of its tail).
CLOSE_TIMEOUT_S = 300.0


class Sink(Protocol):
    def log(
        self,
        step: int,
        wall_time: float,
        scalars: Mapping[str, float],
        histograms: Mapping[str, Sequence[float]],
    ) -> None:
        """One record: the finite scalars (metrics.jsonl keeps the others, as null) and the
        histograms (raw values) of ``step``."""

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table logged at ``step``: one dict per row (a key missing from a row: empty)."""

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class SinkContext:
    """What a sink is opened with."""

    run_dir: storage.epath.Path
    config: RunConfig
    # Resuming a run: the run's earlier records are in the sink already, up to the step a
    # crashed run reached, and the steps after ``resume_after_step`` come again.
    resume_after_step: int | None


SinkFactory = Callable[[SinkContext], Sink]
_REGISTRY: dict[str, SinkFactory] = {}


def register_sink(name: str, factory: SinkFactory) -> None:
    """Makes ``name`` a sink observability.sinks may name; ``factory(context)`` opens it once
    per run (on the sink's own thread)."""
    if not callable(factory):
        raise TypeError(f"register_sink({name!r}): {factory!r} is not callable")
    if name in _REGISTRY:
        raise ValueError(f"sink {name!r} exists already")
    register_sink_name(name)
    _REGISTRY[name] = factory


def registered(name: str) -> SinkFactory | None:
    return _REGISTRY.get(name)


def registered_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def bins(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(counts, edges) of a histogram of ``values``: up to 30 equal-width buckets (fewer for
    fewer distinct values), the same in every sink."""
    v = np.asarray(values, dtype=np.float64)
    edges = np.histogram_bin_edges(v, bins=min(30, max(1, len(np.unique(v)))))
    return np.histogram(v, bins=edges)


class GuardedSink:
    """A sink on its own thread (see the module docstring); ``name`` in its warnings."""

    def __init__(self, name: str, open_sink: Callable[[], Sink]):
        self.name = name
        self.failure: str | None = None  # why it was dropped
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_RECORDS)
        self._full_warned = False
        self._thread = threading.Thread(
            target=self._run, args=(open_sink,), name=f"sink-{name}", daemon=True
        )
        self._thread.start()

    def submit(self, method: str, *args: Any) -> None:
        if self.failure is not None:
            return
        try:
            self._queue.put_nowait((method, args))
        except queue.Full:
            if not self._full_warned:
                self._full_warned = True
                log.warning(
                    "metric sink %r is %d records behind: dropping the newest until it catches up",
                    self.name,
                    QUEUE_RECORDS,
                )

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Waits (at most ``timeout_s``) for the sink to take what it was given and close."""
        with contextlib.suppress(queue.Full):  # then the join below times out too
            self._queue.put((None, ()), timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "metric sink %r did not close within %.0f s; left behind", self.name, timeout_s
            )

    def _fail(self, doing: str, e: BaseException) -> None:
        self.failure = f"{doing}: {type(e).__name__}: {e}"
        log.warning(
            "metric sink %r failed (%s); dropped, the run goes on without it",
            self.name,
            self.failure,
        )

    def _run(self, open_sink: Callable[[], Sink]) -> None:
        try:
            sink = open_sink()
        except Exception as e:  # noqa: BLE001 - any failure of a sink is the sink's
            self._fail("opening", e)
            sink = None
        while True:
            method, args = self._queue.get()
            if method is None:
                break
            if self.failure is None:
                try:
                    getattr(sink, method)(*args)
                except Exception as e:  # noqa: BLE001
                    self._fail(method, e)
        if sink is not None and self.failure is None:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                self._fail("closing", e)
