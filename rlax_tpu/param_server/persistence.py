"""Write-through of hot versions to a persistent kvstore, in the background, and recovery.

A persisted version is ``v<version>/a<i>/`` (zarr3 arrays) plus ``v<version>/manifest.json``,
written last: a version without its manifest is partial. Recovery also re-reads every array and
checks its checksum against the manifest, so a torn or corrupted copy is never taken for complete.

After each successful write, versions older than the newest ``keep`` complete ones are deleted
(manifest first), so the disk holds a bounded number of versions.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import zlib
from collections.abc import Callable

import numpy as np

from rlax_tpu.param_server.codec import VersionManifest, as_bytes, checksum
from rlax_tpu.param_server.store import INTENT, ArrayStore

log = logging.getLogger(__name__)


def persisted_prefix(version: int) -> str:
    return f"v{version:012d}"


class Persister:
    """Copies versions from the hot store to ``location`` on a background thread, in order."""

    def __init__(self, hot: ArrayStore, location: str, *, keep: int = 0):
        self.location = location
        self.keep = keep  # newest complete versions kept on disk; 0: all
        self._hot = hot
        self._store = ArrayStore(location)
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.errors: list[str] = []
        self.failing = ""  # the last write's error while writes fail; "" once one succeeds
        self._thread = threading.Thread(target=self._run, name="param-server-persist", daemon=True)
        self._thread.start()

    def submit(
        self, manifest: VersionManifest, hot_prefix: str, done: Callable[[bool, list[int]], None]
    ) -> None:
        """Queues a copy; ``done(ok, pruned)`` is called on the background thread when it ends
        (``pruned``: versions deleted from ``location`` to stay within ``keep``)."""
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
            ok, pruned = False, []
            try:
                self._write(manifest, hot_prefix)
                ok = True
                self.failing = ""
                pruned = self._prune()
            except Exception as e:  # a full disk must not take the server down; health says it
                msg = f"persisting version {manifest.version} to {self.location} failed: {e}"
                log.error(msg)
                self.errors.append(msg)
                if not ok:
                    self.failing = msg
            finally:
                done(ok, pruned)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, manifest: VersionManifest, hot_prefix: str) -> None:
        prefix = persisted_prefix(manifest.version)
        self._store.delete(prefix)  # an older run's copy of this number, if any
        self._store.write_manifest(prefix, manifest, name=INTENT)
        pending = None
        for i, spec in enumerate(manifest.arrays):
            data = self._hot.read_array(hot_prefix, i, spec).result()
            if pending is not None:
                pending.result()
            pending = self._store.write_array(prefix, i, spec, data)
        if pending is not None:
            pending.result()
        self._store.write_manifest(prefix, manifest)  # the commit marker, last

    def _prune(self) -> list[int]:
        """Deletes versions older than the newest ``keep`` complete ones; returns them.

        Runs on the writer thread right after a write, so no version of ours is half-written
        now; anything older than the kept ones, complete or a torn leftover, is deleted.
        """
        if self.keep <= 0:
            return []
        complete = sorted(self.complete_versions(), reverse=True)
        if len(complete) <= self.keep:
            return []
        oldest_kept = complete[self.keep - 1]
        doomed = sorted(v for v in self.stored_versions() if v < oldest_kept)
        for v in doomed:
            self._store.delete(persisted_prefix(v))
        return doomed

    def torn_versions(self) -> dict[int, VersionManifest]:
        """Versions whose copy was cut short (no commit marker) and what each was going to hold
        (its intent record), newer than every complete one: the server committed them in memory
        and died while persisting."""
        newest = max(self.complete_versions(), default=-1)
        out = {}
        for prefix in self._store.prefixes():
            v = _version_of(prefix)
            if v is None or v <= newest:
                continue
            try:
                intent = self._store.read_manifest(prefix, name=INTENT)
            except (ValueError, KeyError, TypeError):
                intent = None
            if intent is not None and intent.version == v:
                out[v] = intent
        return out

    def complete_versions(self) -> list[int]:
        """Versions whose commit marker (manifest) is written."""
        return [v for p in self._store.manifest_prefixes() if (v := _version_of(p)) is not None]

    def stored_versions(self) -> list[int]:
        """Versions with any key on disk (complete, torn or being written)."""
        return [v for p in self._store.prefixes() if (v := _version_of(p)) is not None]

    def recover(self) -> tuple[VersionManifest, list[np.ndarray]] | None:
        """The newest complete persisted version (manifest present, every checksum right), or None."""
        found = self.recover_newest(1)
        return found[0] if found else None

    def recover_newest(self, limit: int) -> list[tuple[VersionManifest, list[np.ndarray]]]:
        """Up to ``limit`` newest complete persisted versions, newest first (torn or corrupt
        ones are skipped with a warning)."""
        out: list[tuple[VersionManifest, list[np.ndarray]]] = []
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
                arrays = [
                    self._store.read_array(prefix, i, s).result()
                    for i, s in enumerate(manifest.arrays)
                ]
            except (OSError, ValueError) as e:
                log.warning("skipping persisted version %d: %s", version, e)
                continue
            legacy = manifest.checksum == "crc32"  # persisted before CRC32C: zlib's crc32
            check = (lambda a: zlib.crc32(as_bytes(a))) if legacy else checksum
            bad = [
                s.path for s, a in zip(manifest.arrays, arrays, strict=True) if check(a) != s.crc32c
            ]
            if bad:
                log.warning("skipping persisted version %d: checksum mismatch in %s", version, bad)
                continue
            if legacy:  # verified; from here on it is served with CRC32C like every version
                manifest = dataclasses.replace(
                    manifest,
                    checksum="crc32c",
                    arrays=tuple(
                        dataclasses.replace(s, crc32c=checksum(a))
                        for s, a in zip(manifest.arrays, arrays, strict=True)
                    ),
                )
            out.append((manifest, arrays))
            if len(out) == limit:
                break
        return out


def _version_of(prefix: str) -> int | None:
    """The version a persisted prefix holds, or None for a key that is not ours."""
    if len(prefix) == 13 and prefix[0] == "v" and prefix[1:].isdigit():
        return int(prefix[1:])
    return None
