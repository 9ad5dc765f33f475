"""The next version's weights fetched while the engine generates, so a reload is only a swap.

A worker told which version it will load next (``stage``) fetches it on a thread of its own into a
standby copy (a second set of weights on its devices, which the AOT check budgets); the load
then takes that copy (``take``) between two engine steps instead of fetching under an idle engine.
At most one fetch runs and one fetched copy waits at a time, and the next staged version starts
only once the copy taken before it is swapped in (``loaded``): the devices never hold more than
the served weights and one standby copy. Versions are staged in the order asked; a version at or
below the last one taken is not staged again, and a load past staged versions drops them. A staged
fetch that failed (say, asked before the version was published) is tried again by the ``take`` of
its version, which raises if that fails too.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class _Slot:
    def __init__(self, version: int):
        self.version = version
        self.done = threading.Event()
        self.params: Any = None
        self.error: BaseException | None = None
        self.dropped = False  # a load went past it: its copy is let go


class Standby:
    """``fetch(version) -> params`` run ahead of the loads that need it."""

    def __init__(self, fetch: Callable[[int], Any]):
        self._fetch = fetch
        self._lock = threading.Lock()
        self._slot: _Slot | None = None  # fetched or being fetched, for a take
        self._running = False  # a fetch thread is running (its slot possibly dropped)
        self._swapping = False  # a taken copy is not swapped in yet
        self._taken: int | None = None  # the last version taken
        self._queue: collections.deque[int] = collections.deque()  # asked, not started
        self.counts = {"staged": 0, "taken_staged": 0, "fetched_at_load": 0}

    def stage(self, version: int) -> None:
        """Fetches ``version`` in the background (after the copy waiting to be taken, if any)."""
        with self._lock:
            if (
                (self._taken is not None and version <= self._taken)
                or (self._slot is not None and self._slot.version == version)
                or version in self._queue
            ):
                return
            self._queue.append(version)
            self._start_next()

    def take(self, version: int) -> Any:
        """``version``'s weights: the staged copy (waited for if still being fetched), else
        fetched now. Drops the staged versions older than it (a load went past them). The caller
        reports the swap with ``loaded``."""
        with self._lock:
            self._taken = version if self._taken is None else max(self._taken, version)
            self._swapping = True
            self._queue = collections.deque(v for v in self._queue if v > version)
            slot = self._slot
            staged = slot is not None and slot.version == version
            if slot is not None and slot.version <= version:
                self._slot = None  # taken, or past it
                slot.dropped = not staged
        if staged:
            slot.done.wait()
            if slot.error is None:
                with self._lock:
                    self.counts["taken_staged"] += 1
                return slot.params
            # Staged too early (say, before the version was published): the load asks again.
        params = self._fetch(version)
        with self._lock:
            self.counts["fetched_at_load"] += 1
        return params

    def loaded(self) -> None:
        """The copy last taken is swapped in (or was refused): the next staged fetch may start."""
        with self._lock:
            self._swapping = False
            self._start_next()

    def staged(self) -> int | None:
        """The version fetched or being fetched ahead (None: none)."""
        with self._lock:
            return None if self._slot is None else self._slot.version

    def _start_next(self) -> None:
        """Starts fetching the next asked version when no copy waits, none is being fetched and
        none is being swapped in. Holds _lock."""
        if self._slot is not None or self._running or self._swapping or not self._queue:
            return
        slot = self._slot = _Slot(self._queue.popleft())
        self._running = True
        self.counts["staged"] += 1
        threading.Thread(
            target=self._run, args=(slot,), name=f"standby-v{slot.version}", daemon=True
        ).start()

    def _run(self, slot: _Slot) -> None:
        try:
            slot.params = self._fetch(slot.version)
        except BaseException as e:  # noqa: BLE001 - the take of this version fetches again
            log.warning("fetching version %d ahead failed: %s", slot.version, e)
            slot.error = e
        with self._lock:
            self._running = False
            if slot.dropped:  # a load went past it while it ran: let its copy go
                slot.params = None
            slot.done.set()
            self._start_next()
