"""Versions pushed to the weight sink on threads of their own (``trainer.publish_in_flight``).

A push to the parameter server moves the whole version over the trainer's links (at pod scale
the replicas' ingress binds: 16 s for the v5p preset's 61 GiB at 32 Gbit/s); with pushes in
the background the next step computes meanwhile. At most ``limit`` are in flight: a step that
would start one more waits for the oldest (each holds its cast of the weights on the devices,
which the AOT memory check counts). A failed push is raised by the next ``start`` and by every
``wait`` for it or a later version, so a run never goes on past a version it did not publish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PublishError(RuntimeError):
    """A version was not published (this process's push, or another process's part)."""


class BackgroundPushes:
    """Pushes in flight, by version; versions are started in increasing order."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._cond = threading.Condition()
        self._running: dict[int, threading.Thread] = {}
        self._failed: dict[int, BaseException] = {}

    def start(self, version: int, push: Callable[[], None]) -> None:
        """Runs ``push`` (which publishes ``version``) on a thread, once fewer than ``limit``
        pushes are in flight; raises PublishError for a push that failed before."""
        with self._cond:
            while len(self._running) >= self.limit and not self._failed:
                self._cond.wait()
            self._raise_failed(version)
            thread = threading.Thread(
                target=self._run, args=(version, push), name=f"publish-v{version}", daemon=True
            )
            self._running[version] = thread
        thread.start()

    def _run(self, version: int, push: Callable[[], None]) -> None:
        try:
            push()
        except BaseException as e:  # noqa: BLE001 - raised to the trainer's next start or wait
            with self._cond:
                self._failed[version] = e
        finally:
            with self._cond:
                del self._running[version]
                self._cond.notify_all()

    def wait(self, version: int, timeout_s: float | None = None, *, forget: bool = False) -> None:
        """Blocks until no push of ``version`` or an older one is in flight; raises
        PublishError if one of them failed (``forget``: forgets those failures instead, for a
        caller about to publish ``version`` itself), TimeoutError after ``timeout_s``."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: not any(v <= version for v in self._running), timeout=timeout_s
            )
            if not ok:
                raise TimeoutError(f"version {version} is still being published")
            if forget:
                self._failed = {v: e for v, e in self._failed.items() if v > version}
            self._raise_failed(version)

    def check(self) -> None:
        """Raises PublishError if a push failed (whichever version)."""
        with self._cond:
            self._raise_failed(max(self._failed, default=-1))

    def failure(self) -> str:
        """Why the oldest failed push not yet raised away failed ("" none): what the next
        ``start`` or ``wait`` raises."""
        with self._cond:
            if not self._failed:
                return ""
            v = min(self._failed)
            return f"version {v} was not published: {type(self._failed[v]).__name__}: {self._failed[v]}"

    def pending(self) -> list[int]:
        with self._cond:
            return sorted(self._running)

    def drain(self) -> dict[int, BaseException]:
        """Waits for every push in flight; returns (and forgets) the failures."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            failed, self._failed = self._failed, {}
        return failed

    def _raise_failed(self, version: int) -> None:
        failed = {v: e for v, e in self._failed.items() if v <= version}
        if failed:
            v = min(failed)
            e = failed[v]
            raise PublishError(f"version {v} was not published: {type(e).__name__}: {e}") from e
