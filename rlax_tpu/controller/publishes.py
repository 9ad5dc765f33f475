"""Versions the trainer is still pushing to the parameter server (``trainer.publish_in_flight``).

A step returns while its version's push goes on; no worker may load the version before it is
published. A thread per pending version waits for the trainer's word (``wait_published``), then
tells the pool (publish-to-serve starts at the trainer's publish). Jobs of a pending version
wait (``wait``: deterministic generation, evaluations); throughput admission takes the newest
version no longer pending (``newest_ready``). A failed push is raised by every later ``wait``
and ``check``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlax_tpu.trainer.publishing import PublishError


class Publishes:
    def __init__(self, trainer: Any, pool: Any):
        """``trainer``: has ``wait_published(version)``; ``pool``: has ``published(version,
        seconds_ago)``."""
        self._trainer, self._pool = trainer, pool
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._failed: tuple[int, BaseException] | None = None

    def published(self, version: int, seconds_ago: float, *, pending: bool) -> None:
        """The trainer published ``version`` ``seconds_ago`` (its push still under way if
        ``pending``)."""
        if not pending:
            self._pool.published(version, seconds_ago)
            return
        start = time.perf_counter() - seconds_ago
        with self._cond:
            self._pending.add(version)
        threading.Thread(
            target=self._watch, args=(version, start), name=f"published-v{version}", daemon=True
        ).start()

    def _watch(self, version: int, start: float) -> None:
        try:
            self._trainer.wait_published(version)
        except BaseException as e:  # noqa: BLE001 - raised by the controller's next wait/check
            with self._cond:
                self._failed = self._failed or (version, e)
                self._pending.discard(version)
                self._cond.notify_all()
            return
        self._pool.published(version, time.perf_counter() - start)
        with self._cond:
            self._pending.discard(version)
            self._cond.notify_all()

    def wait(self, version: int) -> None:
        """Blocks while ``version`` is being pushed; raises PublishError if a push failed."""
        with self._cond:
            self._cond.wait_for(lambda: version not in self._pending or self._failed)
            self._raise()

    def newest_ready(self, version: int) -> int:
        """``version``, or the newest older one no longer being pushed (never blocks)."""
        with self._cond:
            self._raise()
            while version in self._pending:
                version -= 1
            return version

    def check(self) -> None:
        """Raises PublishError if a push failed."""
        with self._cond:
            self._raise()

    def _raise(self) -> None:
        if self._failed is not None:
            version, e = self._failed
            if isinstance(e, PublishError):
                raise e
            raise PublishError(f"version {version} was not published: {type(e).__name__}: {e}")
