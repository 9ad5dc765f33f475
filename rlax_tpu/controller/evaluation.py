"""Held-out evaluations beside training: started when due, logged against their version when done.

An evaluation of version v no longer stops the controller: it is started (``start``) and runs on
its own thread, one evaluation after another in version order, while the controller goes on
issuing, consuming and training; the controller takes finished ones (``take_done``) between
steps and logs each against v. Its generation goes through the same worker pool as training
(its requests are not counted in the pool's load balance, so training's assignment of requests
to workers stays what it was) in chunks of at most ``data.eval_share`` of the workers' sequence
slots (throughput mode; a chunk fills them in deterministic mode). The version being evaluated
is leased as its own consumer until the evaluation ends.

A run killed with evaluations in flight lists them in its snapshot (``evals_in_flight``, from
``pending``); the resumed run takes a result its metrics already hold, and evaluates the others
again.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
from collections.abc import Callable


def problems_at_once(share: float, workers: int, slots: int, samples: int) -> int:
    """Held-out problems an evaluation sends at a time: ``share`` of every worker's ``slots``
    sequence slots, at ``samples`` sequences a problem (at least one problem)."""
    return max(1, math.floor(share * workers * slots / samples))


class BackgroundEvals:
    """Evaluations of versions by ``evaluate(version) -> metrics``, one thread, version order."""

    def __init__(self, evaluate: Callable[[int], dict[str, float]]):
        self._evaluate = evaluate
        self._executor = cf.ThreadPoolExecutor(1, "eval")
        self._running: dict[int, cf.Future[dict[str, float]]] = {}
        self._lock = threading.Lock()

    def start(self, version: int) -> None:
        with self._lock:
            if version not in self._running:
                self._running[version] = self._executor.submit(self._evaluate, version)

    def pending(self) -> list[int]:
        """Versions started and not yet taken, ascending."""
        with self._lock:
            return sorted(self._running)

    def wait(self) -> None:
        """Returns once every evaluation started has finished (or failed)."""
        with self._lock:
            running = list(self._running.values())
        cf.wait(running)

    def take_done(self, *, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """(version, metrics) of the finished evaluations, ascending, each once; ``wait``: of
        every one started. An evaluation that failed raises here, once the ones before it
        were taken (it stays, and raises again)."""
        if wait:
            self.wait()
        with self._lock:
            running = dict(self._running)
        out = []
        for version in sorted(running):
            fut = running[version]
            if not fut.done():
                continue
            if fut.exception() is not None and out:
                break  # the finished ones first; this one raises at the next call
            metrics = fut.result()
            with self._lock:
                del self._running[version]
            out.append((version, metrics))
        return out

    def close(self, *, wait: bool = False) -> None:
        """Cancels evaluations not started; ``wait``: also waits for the running one."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
