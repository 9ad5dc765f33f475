"""Write-through of hot versions to a persistent kvstore, in the background, and recovery.

A persisted version is ``v<version>/a<i>/`` (zarr3 arrays) plus ``v<version>/manifest.json``,
written last: a version without its manifest is partial. Recovery also re-reads every array and
checks its crc32 against the manifest, so a torn or corrupted copy is never taken for complete.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from rlax_tpu.param_server.codec import VersionManifest, crc32
from rlax_tpu.param_server.store import ArrayStore

log = logging.getLogger(__name__)


def persisted_prefix(version: int) -> str:
    return f"v{version:012d}"


class Persister:
    """Copies versions from the hot store to ``location`` on a background thread, in order."""

    def __init__(self, hot: ArrayStore, location: str):
        self.location = location
        self._hot = hot
        self._store = ArrayStore(location)
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="param-server-persist", daemon=True)
        self._thread.start()

    def submit(
        self, manifest: VersionManifest, hot_prefix: str, done: Callable[[bool], None]
    ) -> None:
        """Queues a copy; ``done(ok)`` is called on the background thread when it ends."""
        with self._idle:
            self._pending += 1
        self._queue.put((manifest, hot_prefix, done))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every submitted version is written (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            manifest, hot_prefix, done = item
            ok = False
            try:
                self._write(manifest, hot_prefix)
                ok = True
            except Exception as e:  # a full disk must not take the server down; health says it
                msg = f"persisting version {manifest.version} to {self.location} failed: {e}"
                log.error(msg)
                self.errors.append(msg)
            finally:
                done(ok)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, manifest: VersionManifest, hot_prefix: str) -> None:
        prefix = persisted_prefix(manifest.version)
        self._store.delete(prefix)  # an older run's copy of this number, if any
        pending = None
        for i, spec in enumerate(manifest.arrays):
            data = self._hot.read_array(hot_prefix, i, spec).result()
            if pending is not None:
                pending.result()
            pending = self._store.write_array(prefix, i, spec, data)
        if pending is not None:
            pending.result()
        self._store.write_manifest(prefix, manifest)  # the commit marker, last

    def recover(self) -> tuple[VersionManifest, list[np.ndarray]] | None:
        """The newest complete persisted version (manifest present, every crc32 right), or None."""
        candidates = []
        for prefix in self._store.manifest_prefixes():
            try:
                manifest = self._store.read_manifest(prefix)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("skipping %s/%s: unreadable manifest (%s)", self.location, prefix, e)
                continue
            if manifest is not None and prefix == persisted_prefix(manifest.version):
                candidates.append((manifest.version, prefix, manifest))
        for version, prefix, manifest in sorted(candidates, reverse=True):
            try:
                arrays = [self._store.read_array(prefix, i, s).result()
                          for i, s in enumerate(manifest.arrays)]  # fmt: skip
            except (OSError, ValueError) as e:
                log.warning("skipping persisted version %d: %s", version, e)
                continue
            bad = [
                s.path for s, a in zip(manifest.arrays, arrays, strict=True) if crc32(a) != s.crc32
            ]
            if bad:
                log.warning("skipping persisted version %d: checksum mismatch in %s", version, bad)
                continue
            return manifest, arrays
        return None
