"""The next version's weights fetched while the engine generates, so a reload is only a swap.

A worker told which version it will load next (``stage``) fetches it on a thread of its own into a
standby copy (a second set of weights on its devices, which the AOT check budgets); the load
then takes that copy (``take``) between two engine steps instead of fetching under an idle engine.
Versions are staged in the order asked, one fetched copy at a time: a version asked while another
is fetched or waits to be taken is fetched after it is taken (jobs load versions in that order),
or dropped when a load skips past it. A staged fetch that failed (say, asked before the version
was published) is tried again by the ``take`` of its version, which raises if that fails too.
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


class Standby:
    """``fetch(version) -> params`` run ahead of the loads that need it."""

    def __init__(self, fetch: Callable[[int], Any]):
        self._fetch = fetch
        self._lock = threading.Lock()
        self._slot: _Slot | None = None  # fetched or being fetched
        self._queue: collections.deque[int] = collections.deque()  # asked, not started
        self.counts = {"staged": 0, "taken_staged": 0, "fetched_at_load": 0}

    def stage(self, version: int) -> None:
        """Fetches ``version`` in the background (after the copy waiting to be taken, if any)."""
        with self._lock:
            if (self._slot is not None and self._slot.version == version) or (
                version in self._queue
            ):
                return
            self._queue.append(version)
            self._start_next()

    def take(self, version: int) -> Any:
        """``version``'s weights: the staged copy (waited for if still being fetched), else
        fetched now. Drops the staged versions older than it (a load went past them)."""
        with self._lock:
            while self._queue and self._queue[0] < version:
                self._queue.popleft()
            slot = self._slot
            if slot is not None and slot.version == version:
                staged = True
            else:
                staged = False
                if slot is not None and slot.version < version:
                    self._drop()
                if version in self._queue:
                    self._queue.remove(version)
        if not staged:
            return self._fetch_now(version)
        slot.done.wait()
        with self._lock:
            if self._slot is slot:
                self._slot = None
            self.counts["taken_staged"] += slot.error is None
            if slot.error is None:
                self._start_next()
        if slot.error is None:
            return slot.params
        # Staged too early (say, before the version was published): the load asks again.
        return self._fetch_now(version)

    def _fetch_now(self, version: int) -> Any:
        try:
            return self._fetch(version)
        finally:
            with self._lock:
                self.counts["fetched_at_load"] += 1
                self._start_next()

    def staged(self) -> int | None:
        """The version fetched or being fetched ahead (None: none)."""
        with self._lock:
            return None if self._slot is None else self._slot.version

    def _drop(self) -> None:
        """Lets go of the slot (its thread, if running, finishes into nothing). Holds _lock."""
        self._slot = None

    def _start_next(self) -> None:
        """Starts fetching the next asked version if no copy is held. Holds _lock."""
        if self._slot is not None or not self._queue:
            return
        slot = self._slot = _Slot(self._queue.popleft())
        self.counts["staged"] += 1
        threading.Thread(
            target=self._run, args=(slot,), name=f"standby-v{slot.version}", daemon=True
        ).start()

    def _run(self, slot: _Slot) -> None:
        try:
            slot.params = self._fetch(slot.version)
        except BaseException as e:  # noqa: BLE001 - raised by the take of this version
            log.warning("fetching version %d ahead failed: %s", slot.version, e)
            slot.error = e
        slot.done.set()
