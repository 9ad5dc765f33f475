"""The parameter server as an in-process object: versioned weights in TensorStore, leases, GC,
write-through persistence. ``service.py`` exposes the same calls over gRPC.

Atomic publish: a version's arrays are written under a fresh staging prefix of the hot store; the
version becomes visible only when its manifest enters the index, under the lock, after every
array is written and its CRC32C checked. Readers resolve versions through the index only, and pin
the version for the duration of a pull, so GC cannot pull it from under them.

Checked reads: a whole-array pull is checked by the puller against the manifest's CRC32C; for
sliced pulls the server records every chunk's CRC32C at commit and checks the chunks a slice
reads (blocks.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import blocks, buffers, errors
from rlax_tpu.param_server.codec import (
    ArraySpec,
    Bounds,
    VersionInfo,
    VersionManifest,
    check_bounds,
    checksum,
    np_dtype,
)
from rlax_tpu.param_server.parts import Assembly, PartSession, Receiver, commit_assembly, cut
from rlax_tpu.param_server.persistence import Persister
from rlax_tpu.param_server.retention import Retention
from rlax_tpu.param_server.store import ArrayStore

log = logging.getLogger(__name__)

LATEST = -1


class ParamServer:
    """Versioned weight store. Thread-safe. ``persist_location`` "" disables persistence."""

    def __init__(self, config: ParamServerConfig, *, persist_location: str = ""):
        self.config = config
        self._hot = ArrayStore("memory")
        self._slabs = buffers.SlabPool()  # received versions' memory, reused once collected
        self._lock = threading.Lock()
        self._index: dict[int, tuple[VersionManifest, str]] = {}  # committed: version -> prefix
        # Committed versions' chunk checksums, one table per array (blocks.py): what sliced pulls
        # are checked against.
        self._chunk_crcs: dict[int, list[np.ndarray]] = {}
        self._publishing: set[int] = set()
        self._assemblies: dict[int, Assembly] = {}  # versions published in parts, incomplete
        # Told of every new version as its publish starts, for a relay that serves it while it
        # arrives (service.CutThrough): (version, arrays) -> a receiver, or None.
        self.receiving: Callable[[int, tuple[ArraySpec, ...]], Receiver | None] | None = None
        self._pins: collections.Counter[int] = collections.Counter()  # pulls and persists in flight
        self._persisted: set[int] = set()
        # Newest version ever committed here (or found persisted): numbers at or below it that
        # are not hot can never be published again, so a number always means the same bytes.
        self._high_water = -1
        # Numbers at or below the high-water mark whose persisted copy was torn by a crash:
        # publishable once more, with exactly the content their intent record names.
        self._torn: dict[int, VersionManifest] = {}
        self._bytes_served = 0  # data bytes handed to pulls (a sharded pull counts its slices)
        self._retention = Retention(
            replicas=config.replicas,
            own=config.replica_index,
            replica_lease_s=config.replica_lease_s,
        )
        self._persister = (
            Persister(self._hot, persist_location, keep=config.persist_keep)
            if persist_location
            else None
        )
        if self._persister is not None:
            self._recover()

    # ------------------------------------------------------------------------------ publish

    def begin_publish(self, version: int, step: int, arrays: Sequence[ArraySpec]) -> PublishSession:
        """Validates a version's declared tree and opens a session that receives its bytes."""
        _check_declaration(version, step, arrays)
        with self._lock:
            existing = self._check_layout_locked(version, arrays)
            if version in self._publishing or version in self._assemblies:
                raise errors.Aborted(f"version {version} is being published by another stream")
            if existing is None:
                self._collectible_locked(need_room=True)  # fail early, collect at commit
            self._publishing.add(version)
        receiver = self._receiver(version, arrays) if existing is None else None
        return PublishSession(
            self, version, step, tuple(arrays), existing=existing, receiver=receiver
        )

    def _receiver(self, version: int, arrays: Sequence[ArraySpec]) -> Receiver | None:
        if self.receiving is None:
            return None
        try:
            return self.receiving(version, tuple(arrays))
        except Exception as e:  # noqa: BLE001 - the version is relayed once committed instead
            log.warning("version %d cannot be relayed while it arrives: %s", version, e)
            return None

    def _check_layout_locked(
        self, version: int, arrays: Sequence[ArraySpec]
    ) -> tuple[VersionManifest, str] | None:
        """The committed version (a retry) or None (a new number, checked); raises when the
        declared tree differs from the committed or the latest version's."""
        existing = self._index.get(version)
        if existing is not None and not _same_layout(existing[0].arrays, arrays):
            raise errors.AlreadyExists(
                f"version {version} exists with a different tree, shapes or dtypes"
            )
        latest = self._latest_locked()
        if existing is None and latest is not None:
            reference = self._index[latest][0].arrays
            if not _same_layout(reference, arrays):
                raise errors.InvalidArgument(
                    f"version {version} does not match the tree, shapes and dtypes of version "
                    f"{latest}: {_first_difference(reference, arrays)}"
                )
        if existing is None:
            self._check_new_number_locked(version)
        return existing

    def begin_part(
        self,
        version: int,
        step: int,
        arrays: Sequence[ArraySpec],
        *,
        part: int,
        parts: int,
        boxes: Sequence[tuple[int, Bounds]],
    ) -> PartSession:
        """Opens part ``part`` of ``parts`` of a version published in parts (parts.py)."""
        _check_declaration(version, step, arrays)
        if not 0 <= part < parts:
            raise errors.InvalidArgument(f"part {part} is not in [0, {parts})")
        with self._lock:
            existing = self._check_layout_locked(version, arrays)
            if existing is not None:  # a retry after the commit: compared, not stored
                return PartSession(self, None, part, boxes, committed=existing, arrays=arrays)
            if version in self._publishing:
                raise errors.Aborted(f"version {version} is being published by another stream")
            assembly = self._assemblies.get(version)
            if assembly is None:
                self._collectible_locked(need_room=True)  # fail early, collect at commit
                for old in [v for v in self._assemblies if v < version]:
                    log.warning(
                        "dropping unfinished version %d: version %d is being published",
                        old,
                        version,
                    )
                    dropped = self._assemblies.pop(old)
                    if dropped.receiver is not None:
                        dropped.receiver.failed(errors.Aborted(f"version {old} was dropped"))
                assembly = Assembly.create(version, step, arrays, parts)
                assembly.receiver = self._receiver(version, arrays)
                self._assemblies[version] = assembly
            elif (assembly.parts, assembly.step) != (parts, step) or not _same_layout(
                assembly.arrays, arrays
            ):
                raise errors.InvalidArgument(
                    f"part {part} of version {version} declares {parts} parts at step {step} or "
                    f"another tree; its other parts declared {assembly.parts} at {assembly.step}"
                )
            if assembly.finishing:
                raise errors.Aborted(f"version {version} is being committed")
            assembly.claim(part, boxes)
        return PartSession(self, assembly, part, boxes, committed=None, arrays=arrays)

    def _finish_part(
        self, assembly: Assembly, part: int, boxes: list, values: list, crcs: list[int]
    ) -> tuple[VersionInfo, bool, bool]:
        """A part's checked boxes into its version; the part completing it commits it."""
        info = VersionInfo(
            version=assembly.version,
            step=assembly.step,
            nbytes=sum(a.nbytes for a in assembly.arrays),
        )
        with self._lock:
            if self._assemblies.get(assembly.version) is not assembly:
                raise errors.Aborted(f"version {assembly.version} was dropped or committed")
            if part in assembly.done:
                if assembly.done[part] != crcs or assembly.claimed[part] != boxes:
                    raise errors.AlreadyExists(
                        f"part {part} of version {assembly.version} was sent with other content"
                    )
                return info, True, False
        for (i, bounds), value in zip(boxes, values, strict=True):  # disjoint: no lock needed
            assembly.data[i][cut(bounds)] = value
        with self._lock:
            assembly.done[part] = crcs
            complete = len(assembly.done) == assembly.parts and not assembly.finishing
            if complete:
                missing = assembly.uncovered()
                if missing:
                    del self._assemblies[assembly.version]
                    raise errors.DataLoss(
                        f"version {assembly.version}: its {assembly.parts} parts leave arrays "
                        f"uncovered: {missing}"
                    )
                assembly.finishing = True
        if not complete:
            return info, False, False
        try:
            info = commit_assembly(self, assembly)
        except errors.ResourceExhausted:
            # No room yet (a client retries it): the other parts' data stays, and this part sent
            # again completes the version then.
            with self._lock:
                assembly.finishing = False
                del assembly.done[part]
            raise
        except BaseException:
            with self._lock:
                self._assemblies.pop(assembly.version, None)
            raise
        with self._lock:
            self._assemblies.pop(assembly.version, None)
        if assembly.receiver is not None:  # committed from checked parts: served whole now
            assembly.receiver.checked(None)
        return info, False, True

    def publish(
        self, version: int, step: int, paths: Sequence[str], arrays: Sequence[np.ndarray]
    ) -> tuple[VersionInfo, bool]:
        """In-process publish of host arrays. Returns (info, already_present)."""
        specs = [
            ArraySpec(path=p, shape=tuple(a.shape), dtype=np.dtype(a.dtype).name)
            for p, a in zip(paths, arrays, strict=True)
        ]
        session = self.begin_publish(version, step, specs)
        try:
            crcs = []
            for i, a in enumerate(arrays):
                data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # add() copies it
                session.add(i, 0, data)
                crcs.append(checksum(data))
            return session.finish(crcs)
        finally:
            session.abort()

    def _commit(
        self, manifest: VersionManifest, prefix: str, chunk_crcs: list[np.ndarray]
    ) -> list[str]:
        """Makes a written version visible (``chunk_crcs``: each array's chunk checksums, from
        the checked bytes); returns hot prefixes collected to make room."""
        with self._lock:
            self._check_new_number_locked(manifest.version, manifest)  # a newer one may have won
            self._torn.pop(manifest.version, None)
            doomed = self._collectible_locked(need_room=True)
            for v in doomed:
                self._index.pop(v)
                self._chunk_crcs.pop(v, None)
                self._persisted.discard(v)
            self._index[manifest.version] = (manifest, prefix)
            self._chunk_crcs[manifest.version] = chunk_crcs
            self._high_water = max(self._high_water, manifest.version)
            self._retention.report_progress(
                self.config.replica_index, max(self._index)
            )  # our own progress
            persist = (
                self._persister is not None
                and self.config.persist_every > 0
                and (manifest.version % self.config.persist_every == 0)
            )
            if persist:
                self._pins[manifest.version] += 1
        if persist:
            self._persister.submit(
                manifest, prefix, lambda ok, pruned: self._persist_done(manifest, ok, pruned)
            )
        return [p for p in doomed.values()]

    def _persist_done(self, manifest: VersionManifest, ok: bool, pruned: list[int]) -> None:
        with self._lock:
            self._unpin_locked(manifest.version)
            self._persisted.difference_update(pruned)
            if ok and manifest.version in self._index:
                self._persisted.add(manifest.version)

    def _check_new_number_locked(
        self, version: int, manifest: VersionManifest | None = None
    ) -> None:
        """Refuses a version number that is not hot but was already used (or skipped) here; a
        number whose persisted copy was torn is taken again with the same content (checked on
        commit, ``manifest`` given, against its intent record)."""
        if version in self._torn:
            want = self._torn[version]
            if manifest is not None and not _same_content(want, manifest):
                raise errors.FailedPrecondition(
                    f"version {version} differs from the version {version} this server committed "
                    f"before it restarted (its checksums are recorded): version numbers always "
                    f"mean the same bytes; publish version {self._high_water + 1} or later"
                )
            return
        if version <= self._high_water:
            raise errors.FailedPrecondition(
                f"version {version} is not held and is not newer than version {self._high_water}, "
                f"the newest this server has committed: version numbers are never reused (an "
                f"older version that was collected cannot be compared with or replaced), publish "
                f"version {self._high_water + 1} or later"
            )

    # ------------------------------------------------------------------------------ retention

    def _collectible_locked(self, *, need_room: bool) -> dict[int, str]:
        """Versions to drop so one more fits in K (oldest first); raises if that is impossible."""
        if not need_room or len(self._index) < self.config.in_memory_versions:
            return {}
        latest = self._latest_locked()
        reasons = []
        for v in sorted(self._index):
            why = self._retention.blocker(v) if v != latest else "it is the latest"
            if why is None and self._pins[v]:
                why = f"version {v} is being read or persisted"
            if why is None:
                return {v: self._index[v][1]}
            reasons.append(why)
        raise errors.ResourceExhausted(
            f"{len(self._index)} versions are hot (in_memory_versions="
            f"{self.config.in_memory_versions}) and none can be collected: {'; '.join(reasons)}"
        )

    def report_progress(self, replica: int, version: int, missed: bool = False) -> None:
        """Replica ``replica`` has committed ``version`` (versions before it may be collected);
        renews its say in GC for ``replica_lease_s`` (retention.py). ``missed``: it did not
        take ``version``, so its say ends now."""
        with self._lock:
            if missed:
                self._retention.missed(replica)
            else:
                self._retention.report_progress(replica, version)

    def lease(self, consumer: str, versions: Sequence[int], ttl_s: float = 0.0) -> float:
        """Sets the versions ``consumer`` holds (replacing its previous set); returns the TTL."""
        ttl_s = ttl_s or self.config.lease_ttl_s
        with self._lock:
            missing = sorted(v for v in set(versions) if v not in self._index)
            if missing:
                raise errors.NotFound(
                    f"cannot lease versions {missing}: not held (hot: {sorted(self._index)})"
                )
            self._retention.set_lease(consumer, versions, ttl_s)
        return ttl_s

    # ------------------------------------------------------------------------------ reads

    def _latest_locked(self) -> int | None:
        return max(self._index) if self._index else None

    def _unpin_locked(self, version: int) -> None:
        self._pins[version] -= 1
        if self._pins[version] <= 0:
            del self._pins[version]

    def list_versions(self) -> list[VersionInfo]:
        with self._lock:
            return [
                VersionInfo(
                    version=v,
                    step=m.step,
                    nbytes=m.nbytes,
                    persisted=v in self._persisted,
                    leased_by=tuple(self._retention.holders(v)),
                )
                for v, (m, _) in sorted(self._index.items())
            ]

    def latest(self) -> int | None:
        with self._lock:
            return self._latest_locked()

    def pull(
        self,
        version: int = LATEST,
        slices: Sequence[tuple[int, Bounds | None]] | None = None,
        *,
        piece_bytes: int = 4 * 2**20,
        reuse_buffers: bool = False,
    ) -> tuple[VersionManifest, VersionReader]:
        """(manifest, pieces) of whole arrays in order, or of each requested (array, bounds) box.

        A piece ``(k, offset, rows)`` is a run of leading-dim rows of box k (about
        ``piece_bytes``), starting at byte ``offset`` of the box's C-order bytes. Reading in
        pieces keeps buffers small and lets sending start before a whole array is read. The
        version stays pinned until the reader is exhausted, closed or dropped.

        ``reuse_buffers``: pieces are read straight into a few buffers that are used over and
        over (no new memory per piece), so a piece is valid only until the next one is asked
        for; for a caller that is done with each piece by then (the gRPC service sends it).

        Requested boxes (``slices`` given) are checked on the server, and iterating raises
        DataLoss at one that differs from what was published (``_read_checked``).
        """
        with self._lock:
            if version == LATEST:
                version = self._latest_locked()
                if version is None:
                    raise errors.NotFound("no version has been published yet")
            if version not in self._index:
                raise errors.NotFound(f"version {version} is not held (hot: {sorted(self._index)})")
            manifest, prefix = self._index[version]
            tables = self._chunk_crcs[version]
            self._pins[version] += 1
        reader = VersionReader(self, manifest)  # owns the pin from here on, whatever happens
        checked = slices is not None
        try:
            if slices is None:
                slices = [(i, None) for i in range(len(manifest.arrays))]
            boxes = []
            for i, bounds in slices:
                if not 0 <= i < len(manifest.arrays):
                    raise errors.InvalidArgument(f"array index {i} is not in version {version}")
                spec = manifest.arrays[i]
                if bounds is None:
                    bounds = tuple((0, d) for d in spec.shape)
                check_bounds(spec, bounds)
                boxes.append((i, tuple(bounds)))
        except errors.ParamServerError:
            reader.close()
            raise
        if checked:
            reader.start(
                _read_checked(
                    self._hot, manifest, prefix, boxes, tables, piece_bytes, reuse_buffers
                )
            )
        else:
            reader.start(_read(self._hot, manifest, prefix, boxes, piece_bytes, reuse_buffers))
        return manifest, reader

    def _unpin(self, version: int) -> None:
        with self._lock:
            self._unpin_locked(version)

    def bytes_served(self) -> int:
        """Data bytes read out by pulls so far (headers not counted)."""
        with self._lock:
            return self._bytes_served

    def _count_served(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_served += nbytes

    def pins(self) -> dict[int, int]:
        """Pulls and persists in flight per version (what keeps GC off a version right now)."""
        with self._lock:
            return dict(self._pins)

    # ------------------------------------------------------------------------------ lifecycle

    def _recover(self) -> None:
        used = self._persister.stored_versions()  # every one was committed before being persisted
        self._high_water = max(used, default=-1)
        self._torn = self._persister.torn_versions()
        for v in sorted(self._torn):
            log.info(
                "version %d was cut short while persisting; it may be published again "
                "with the content its intent record names",
                v,
            )
        # The newest complete versions that fit in memory: a resumed controller may still need
        # the older ones (rollouts generated with them are re-issued).
        keep = self.config.in_memory_versions
        if self.config.persist_keep:
            keep = min(keep, self.config.persist_keep)
        found = self._persister.recover_newest(keep)
        if not found:
            log.info("no complete persisted version in %s", self._persister.location)
            return
        for manifest, arrays in reversed(found):
            prefix = f"v{manifest.version}-{uuid.uuid4().hex[:8]}"
            pending = [
                self._hot.write_array(prefix, i, s, a)
                for i, (s, a) in enumerate(zip(manifest.arrays, arrays, strict=True))
            ]
            for f in pending:
                f.result()
            tables = [
                blocks.chunk_checksums(s, a) for s, a in zip(manifest.arrays, arrays, strict=True)
            ]
            with self._lock:
                self._index[manifest.version] = (manifest, prefix)
                self._chunk_crcs[manifest.version] = tables
                self._persisted.add(manifest.version)
                self._retention.report_progress(self.config.replica_index, manifest.version)
            log.info("recovered version %d from %s", manifest.version, self._persister.location)

    def stored_prefixes(self) -> tuple[set[str], set[str]]:
        """(prefixes of committed versions, every prefix with data in the hot store).

        They are equal when no publish is in flight: a failed one leaves nothing behind.
        """
        with self._lock:
            committed = {p for _, p in self._index.values()}
        return committed, self._hot.prefixes()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits for background persistence to catch up."""
        return self._persister is None or self._persister.flush(timeout_s)

    def health(self) -> tuple[bool, str]:
        """(serving, detail). Not serving while persistence fails: new versions are then hot
        only, and a restart would lose them."""
        with self._lock:
            hot = sorted(self._index)
            persisted = sorted(self._persisted)
            served = self._bytes_served
            progress, counted = self._retention.progress(), self._retention.counted()
        detail = (
            f"hot versions {hot}; persisted {persisted}; {served} bytes served; replica progress "
            f"{dict(sorted(progress.items()))}, counted for GC {counted}"
        )
        failing = self._persister.failing if self._persister is not None else ""
        if failing:
            return False, f"{detail}; persistence is failing: {failing}"
        return True, detail

    def close(self) -> None:
        if self._persister is not None:
            self._persister.close()


class VersionReader(Iterator[tuple[int, int, np.ndarray]]):
    """The pieces of one pull, holding the version's pin until ``close``.

    ``close`` is idempotent, safe from another thread (gRPC's termination callback), and also
    runs when the reader is dropped unstarted or half-read: a pin can never outlive its reader.
    """

    def __init__(self, server: ParamServer, manifest: VersionManifest):
        self.manifest = manifest
        self._pieces: Iterator[tuple[int, int, np.ndarray]] | None = None
        self._closed = False
        self._count = server._count_served
        # Not a method of self: the finalizer must not keep the reader alive.
        self._release = weakref.finalize(self, server._unpin, manifest.version)

    def start(self, pieces: Iterator[tuple[int, int, np.ndarray]]) -> None:
        self._pieces = pieces

    def __next__(self) -> tuple[int, int, np.ndarray]:
        pieces = self._pieces
        if self._closed or pieces is None:
            raise StopIteration
        try:
            piece = next(pieces)
        except StopIteration:
            self.close()  # exhausted: release now rather than when dropped
            raise
        self._count(piece[2].nbytes)
        return piece

    def close(self) -> None:
        self._closed = True
        self._release()
        pieces, self._pieces = self._pieces, None
        if pieces is not None:
            with contextlib.suppress(ValueError):  # running on another thread: it stops next step
                pieces.close()


_READ_AHEAD = 2  # pieces being read while the one before them is consumed


def _read(
    hot: ArrayStore,
    manifest: VersionManifest,
    prefix: str,
    boxes: list[tuple[int, Bounds]],
    piece_bytes: int,
    reuse: bool,
) -> Iterator[tuple[int, int, np.ndarray]]:
    pending = collections.deque()  # a few reads in flight while earlier pieces are sent
    # With ``reuse``, piece p is read into ring[p % len(ring)]: when it is started, the piece
    # that used that buffer before (p - len(ring)) has been handed out and its consumer has
    # asked for the next piece since, so it is done with it.
    ring: list[np.ndarray | None] = [None] * (_READ_AHEAD + 1)
    p = 0
    for k, (i, bounds) in enumerate(boxes):
        spec = manifest.arrays[i]
        dtype = np_dtype(spec.dtype)
        for offset, piece in _pieces(spec, bounds, piece_bytes):
            if reuse:
                shape = tuple(hi - lo for lo, hi in piece)
                nbytes = math.prod(shape) * dtype.itemsize
                slot = p % len(ring)
                if ring[slot] is None or ring[slot].nbytes < nbytes:
                    ring[slot] = np.empty(max(nbytes, piece_bytes), np.uint8)
                out = ring[slot][:nbytes].view(dtype).reshape(shape)
                pending.append((k, offset, hot.read_into(prefix, i, spec, piece, out), out))
            else:
                pending.append((k, offset, hot.read_array(prefix, i, spec, piece), None))
            p += 1
            if len(pending) > _READ_AHEAD:
                yield _done(pending.popleft())
    while pending:
        yield _done(pending.popleft())


def _read_checked(
    hot: ArrayStore,
    manifest: VersionManifest,
    prefix: str,
    boxes: list[tuple[int, Bounds]],
    tables: list[np.ndarray],
    piece_bytes: int,
    reuse: bool,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """The pieces of requested boxes, checked. A box that is a whole array (a replicated one, or
    all a reader needs of it) is read in row pieces like a whole pull and its CRC32C compared
    with the manifest's after its last piece: the pull then fails instead of ending, so the
    puller keeps none of it, and memory stays a few pieces. Any other box is read as the whole
    chunks covering it, each checked against the chunk checksums recorded at commit before its
    part of the box is handed out (blocks.py): memory is a band of chunks."""
    for k, (i, bounds) in enumerate(boxes):
        spec = manifest.arrays[i]
        if bounds != tuple((0, d) for d in spec.shape):
            for _, offset, piece in blocks.read_checked(
                hot, prefix, [(i, spec, bounds, tables[i])]
            ):
                yield k, offset, piece
            continue
        crc = 0
        for _, offset, piece in _read(hot, manifest, prefix, [(i, bounds)], piece_bytes, reuse):
            crc = checksum(piece, crc)
            yield k, offset, piece
        if crc != spec.crc32c:
            raise errors.DataLoss(
                f"array {i} ({spec.path}) of the stored copy does not match the checksum it was "
                f"published with"
            )


def _done(read: tuple[int, int, Any, np.ndarray | None]) -> tuple[int, int, np.ndarray]:
    k, offset, future, out = read
    got = future.result()
    return k, offset, got if out is None else out


def _pieces(spec: ArraySpec, bounds: Bounds, piece_bytes: int) -> Iterator[tuple[int, Bounds]]:
    """(byte offset, bounds) of runs of leading-dim rows of a box, about piece_bytes each."""
    if not bounds:  # a scalar
        yield 0, bounds
        return
    (lo, hi), rest = bounds[0], bounds[1:]
    row = np_dtype(spec.dtype).itemsize * math.prod(b - a for a, b in rest)
    step = max(1, piece_bytes // max(row, 1))
    for start in range(lo, max(hi, lo + 1), step):
        yield (start - lo) * row, ((start, min(start + step, hi)), *rest)


def _check_declaration(version: int, step: int, arrays: Sequence[ArraySpec]) -> None:
    if version < 0 or step < 0:
        raise errors.InvalidArgument(f"version and step must be >= 0, got {version}, {step}")
    if not arrays:
        raise errors.InvalidArgument(f"version {version} declares no arrays")
    paths = [a.path for a in arrays]
    if len(set(paths)) != len(paths):
        raise errors.InvalidArgument(f"version {version} declares a path twice")


def _same_layout(a: Sequence[ArraySpec], b: Sequence[ArraySpec]) -> bool:
    return len(a) == len(b) and all(x.same_layout(y) for x, y in zip(a, b, strict=True))


def _first_difference(reference: Sequence[ArraySpec], arrays: Sequence[ArraySpec]) -> str:
    if len(reference) != len(arrays):
        return f"{len(arrays)} arrays instead of {len(reference)}"
    for r, a in zip(reference, arrays, strict=True):
        if not r.same_layout(a):
            return (
                f"{a.path} is {a.dtype}{list(a.shape)}, expected {r.path} {r.dtype}{list(r.shape)}"
            )
    return "no difference"


class PublishSession:
    """Receives one version's bytes: arrays in declared order, each as contiguous chunks.

    Every array of the version is created in the hot store when the session opens (concurrently,
    while the bytes are still on their way), and each array's write starts as soon as its last
    byte has arrived and its array exists, so storing overlaps receiving and no chunk waits on
    the store; checksums are computed chunk by chunk. Nothing is visible until ``finish`` commits.
    """

    def __init__(
        self,
        server: ParamServer,
        version: int,
        step: int,
        arrays: tuple[ArraySpec, ...],
        *,
        existing: tuple[VersionManifest, str] | None,
        receiver: Receiver | None = None,
    ):
        self._server, self.version, self.step, self.arrays = server, version, step, arrays
        self._receiver = receiver  # told of each array as it is whole, and of the check
        self._existing = existing  # a retry of a committed version: only checksums are compared
        self._prefix = f"v{version}-{uuid.uuid4().hex[:8]}"
        self._current, self._received = -1, 0
        # Where the arrays are received: one slab for the whole version, allocated by the first
        # chunk and handed to the store array by array. A retry only has its checksums compared.
        self._offsets, self._slab_bytes = buffers.layout([a.nbytes for a in arrays])
        self._slab: np.ndarray | None = None
        self._crcs: list[int] = []
        self._crc = 0
        self._writes: list = []
        self._creates: list = []  # array i's creation; none for a retry (compared, not stored)
        self._sealed: collections.deque[tuple[int, ArraySpec, np.ndarray]] = collections.deque()
        self._open = True
        try:
            if existing is None:
                for i, s in enumerate(arrays):  # may raise at once (a spec the store refuses)
                    self._creates.append(server._hot.create_array(self._prefix, i, s))
            self._advance_to(0)
        except BaseException:
            # The version number is held (begin_publish) and some arrays may already exist under
            # the staging prefix: give both back, or the number stays blocked for good.
            self._close(keep=False)
            raise

    def _advance_to(self, index: int) -> None:
        """Closes arrays before ``index`` (each must be complete) and starts ``index``."""
        while self._current < index:
            if self._current >= 0:
                spec = self.arrays[self._current]
                if self._received != spec.nbytes:
                    raise errors.InvalidArgument(
                        f"chunk for array {index} arrived while array {self._current} ({spec.path}) "
                        f"has {self._received} of {spec.nbytes} bytes"
                    )
                self._seal(spec)
            self._current += 1
            if self._current < len(self.arrays):
                self._received, self._crc = 0, 0

    def _array_bytes(self, i: int) -> np.ndarray:
        """Array i's bytes in the slab (allocated, or reused from a collected version, here)."""
        if self._slab is None:
            self._slab = self._server._slabs.take(self._slab_bytes)
        start = self._offsets[i]
        return self._slab[start : start + self.arrays[i].nbytes]

    def _seal(self, spec: ArraySpec) -> None:
        self._crcs.append(self._crc)
        if self._existing is None:
            data = self._array_bytes(self._current).view(np_dtype(spec.dtype)).reshape(spec.shape)
            self._sealed.append((self._current, spec, data))
            self._start_writes(wait=False)
            if self._receiver is not None:
                self._receiver.array(self._current, self._array_bytes(self._current))

    def _start_writes(self, *, wait: bool) -> None:
        """Starts the writes of sealed arrays whose creation is done (all of them if ``wait``)."""
        while self._sealed and (wait or self._creates[self._sealed[0][0]].done()):
            i, spec, data = self._sealed.popleft()
            store = self._creates[i].result()
            self._writes.append(self._server._hot.write_created(self._prefix, i, store, spec, data))

    def add(self, index: int, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        """Bytes [offset, offset + len(data)) of array ``index``; ``data`` is copied."""
        if not self._open:
            raise errors.InvalidArgument("the publish session is closed")
        if not 0 <= index < len(self.arrays) or index < self._current:
            raise errors.InvalidArgument(
                f"chunk for array {index}: arrays must arrive in order 0..{len(self.arrays) - 1}, "
                f"now at {self._current}"
            )
        self._advance_to(index)
        spec, n = self.arrays[index], len(data)
        if offset != self._received:
            raise errors.InvalidArgument(
                f"array {index} ({spec.path}): chunk at offset {offset}, expected {self._received}"
            )
        if offset + n > spec.nbytes:
            raise errors.InvalidArgument(
                f"array {index} ({spec.path}) is declared {spec.dtype}{list(spec.shape)} = "
                f"{spec.nbytes} bytes, got at least {offset + n}"
            )
        data = np.frombuffer(data, np.uint8)
        if self._existing is None:
            # Our own writable buffer, handed to the store by reference once the array is whole
            # (TensorStore copies read-only sources, such as the received messages, slowly).
            self._array_bytes(index)[offset : offset + n] = data
        self._crc = checksum(data, self._crc)  # while the chunk is still in cache
        self._received += n

    def finish(self, crcs: Sequence[int]) -> tuple[VersionInfo, bool]:
        """Checks completeness and checksums, then commits. Returns (info, already_present)."""
        if len(crcs) != len(self.arrays):
            raise errors.InvalidArgument(f"{len(crcs)} checksums for {len(self.arrays)} arrays")
        last = self.arrays[self._current] if self._current < len(self.arrays) else None
        if self._current < len(self.arrays) - 1 or (last and self._received != last.nbytes):
            raise errors.DataLoss(
                f"truncated publish of version {self.version}: array {self._current} "
                f"({last.path}) has {self._received} of {last.nbytes} bytes"
            )
        self._advance_to(len(self.arrays))
        got = self._crcs
        bad = [s.path for s, g, c in zip(self.arrays, got, crcs, strict=True) if g != c]
        if bad:
            raise errors.DataLoss(f"version {self.version}: checksum mismatch in {bad}")
        self._start_writes(wait=True)
        tables = []
        if self._existing is None:  # from the bytes just checked, while the writes run
            for i, spec in enumerate(self.arrays):
                data = self._array_bytes(i).view(np_dtype(spec.dtype)).reshape(spec.shape)
                tables.append(blocks.chunk_checksums(spec, data))
        for w in self._writes:
            w.result()
        manifest = VersionManifest(
            version=self.version,
            step=self.step,
            arrays=tuple(
                dataclasses.replace(s, crc32c=c) for s, c in zip(self.arrays, got, strict=True)
            ),
        )
        info = VersionInfo(version=self.version, step=self.step, nbytes=manifest.nbytes)
        if self._existing is not None:
            if [a.crc32c for a in self._existing[0].arrays] != got or self._existing[
                0
            ].step != self.step:
                raise errors.AlreadyExists(
                    f"version {self.version} exists with different content; versions are immutable"
                )
            self._close(keep=False)
            return dataclasses.replace(info, step=self._existing[0].step), True
        doomed = self._server._commit(manifest, self._prefix, tables)
        self._close(keep=True)
        if self._receiver is not None:  # committed as published: it may be served whole now
            self._receiver.checked(got)
        for prefix in doomed:
            self._server._hot.delete(prefix)
        self._server._slabs.trim()  # the collected versions' slabs are idle now
        return info, False

    def abort(self) -> None:
        """Drops whatever was staged (a no-op after a successful finish)."""
        if self._open:
            self._close(keep=False)

    def _close(self, *, keep: bool) -> None:
        self._open = False
        if not keep and self._receiver is not None:
            self._receiver.failed(errors.Aborted(f"the publish of version {self.version} ended"))
        self._slab = None  # the store holds what it keeps of it
        with self._server._lock:
            self._server._publishing.discard(self.version)
        self._sealed.clear()
        if not keep:
            for f in (*self._creates, *self._writes):
                f.exception()  # wait: a late create or write must not recreate deleted keys
            self._server._hot.delete(self._prefix)


def _same_content(a: VersionManifest, b: VersionManifest) -> bool:
    key = lambda m: [(s.path, s.dtype, tuple(s.shape), s.crc32c) for s in m.arrays]  # noqa: E731
    return a.checksum == b.checksum and key(a) == key(b)
