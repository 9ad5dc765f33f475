"""Versions the trainer is still pushing to the parameter server (``trainer.publish_in_flight``).

A step returns while its version's push goes on; no worker may load the version before it is
published (with ``stage_early`` the workers fetch it meanwhile, relayed as it arrives, and swap
it in once it is published). A thread per pending version waits for the trainer's word
(``wait_published``), then tells the pool (publish-to-serve starts at the trainer's publish).
Generation jobs go to the pool through one queue (``after``) that holds a job of a pending
version until it is published, so the controller's thread goes on (the next update overlaps the push) and jobs reach the pool
in the order they were launched; evaluations wait (``wait``); throughput admission takes the
newest reload point no longer pending (``newest_ready``). A failed push is raised by every
later ``wait``, ``after`` and ``check`` as it was raised: a component gone (which the
controller's recovery handles) or the trainer's PublishError.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Publishes:
    def __init__(
        self,
        trainer: Any,
        pool: Any,
        *,
        in_flight: bool = True,
        stage_early: Callable[[int], int | None] | None = None,
    ):
        """``trainer``: has ``wait_published(version)``; ``pool``: has ``published(version,
        seconds_ago)`` and ``stage(version, holding=)``; ``in_flight`` False: no version is
        ever pending (jobs go straight to the pool); ``stage_early(version)``: the version a
        worker holds when it is to fetch ``version`` while it is still being pushed (relayed
        as it arrives, ``param_server.fanout`` "relay": a reload point, and the one before it),
        or None."""
        self._trainer, self._pool, self.in_flight = trainer, pool, in_flight
        self._stage_early = stage_early
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._failed: BaseException | None = None
        self._queue = cf.ThreadPoolExecutor(1, "launch")  # in launch order
        self._waiting: set[cf.Future] = set()  # after()'s futures not yet handed to the pool
        self._closed = False

    def published(self, version: int, seconds_ago: float, *, pending: bool) -> None:
        """The trainer published ``version`` ``seconds_ago`` (its push still under way if
        ``pending``)."""
        if not pending:
            self._pool.published(version, seconds_ago)
            return
        start = time.perf_counter() - seconds_ago
        with self._cond:
            self._pending.add(version)
        holding = self._stage_early(version) if self._stage_early is not None else None
        if holding is not None:
            self._pool.stage(version, holding=holding)  # relayed while the push goes on
        threading.Thread(
            target=self._watch, args=(version, start), name=f"published-v{version}", daemon=True
        ).start()

    def _watch(self, version: int, start: float) -> None:
        try:
            self._trainer.wait_published(version)
            self._pool.published(version, time.perf_counter() - start)
        except BaseException as e:  # noqa: BLE001 - raised by the controller's next wait/check
            with self._cond:
                self._failed = self._failed or e
        finally:
            with self._cond:
                self._pending.discard(version)
                self._cond.notify_all()

    def pending(self, version: int) -> bool:
        with self._cond:
            return version in self._pending

    def wait(self, version: int) -> None:
        """Blocks while ``version`` is being pushed; raises a push's failure."""
        with self._cond:
            self._cond.wait_for(lambda: version not in self._pending or self._failed)
            self._raise()

    def after(self, version: int, submit: Callable[[], cf.Future[T]]) -> cf.Future[T]:
        """``submit()``'s future, called once ``version`` is published, after every job
        launched before it (their order is the pool's); the caller does not wait."""
        if not self.in_flight:
            return submit()
        out: cf.Future[T] = cf.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the controller is closed")
            self._waiting.add(out)

        def run() -> None:
            try:
                self.wait(version)
                inner = submit()
            except BaseException as e:  # noqa: BLE001 - the job's failure
                _fail(out, e)
                return
            finally:
                with self._cond:
                    self._waiting.discard(out)
            inner.add_done_callback(lambda f: _copy(f, out))

        self._queue.submit(run)
        return out

    def newest_ready(self, version: int, reload_point: Callable[[int], int]) -> int:
        """The reload point of ``version``, or the newest older reload point no longer being
        pushed (never blocks)."""
        with self._cond:
            self._raise()
            w = reload_point(version)
            while w in self._pending and w > 0:
                w = reload_point(w - 1)
            return w

    def check(self) -> None:
        """Raises a push's failure, if one failed."""
        with self._cond:
            self._raise()

    def close(self) -> None:
        """Jobs not yet handed to the pool fail (whoever waits on them returns)."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), set()
            self._failed = self._failed or RuntimeError("the controller is closed")
            self._cond.notify_all()  # a wait() returns, raising
        self._queue.shutdown(wait=False, cancel_futures=True)
        for out in waiting:
            _fail(out, RuntimeError("the controller closed before this job reached the pool"))

    def _raise(self) -> None:
        if self._failed is not None:
            raise self._failed


def _fail(target: cf.Future, error: BaseException) -> None:
    if not target.done():
        with contextlib.suppress(cf.InvalidStateError):  # set meanwhile
            target.set_exception(error)


def _copy(source: cf.Future, target: cf.Future) -> None:
    if target.done():  # failed by close()
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
