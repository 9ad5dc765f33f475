"""A version published in parts: each host of a multi-host trainer sends the boxes of the arrays
its own devices hold, and nobody gathers the whole model.

Part p of n declares the whole version's arrays (every part the same) and the boxes it sends
(``(array index, bounds)``, disjoint from every other part's). Its bytes arrive box by box, in
order, each box as contiguous chunks of its C-order bytes, and end with one CRC32C per box. Boxes
land in the version's arrays as parts finish; the part that completes the set checks that the
parts cover every array exactly, computes the whole arrays' CRC32C and commits the version the
way a whole publish does (``ParamServer._commit``). Until then nothing is visible.

A part sent again is compared, not stored: identical bytes are ``already_present``, others are
refused, before and after the version commits (a version is immutable). An unfinished version is
dropped when a newer version starts assembling (its publisher moved on or died).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rlax_tpu.param_server import blocks, errors
from rlax_tpu.param_server.codec import (
    ArraySpec,
    Bounds,
    VersionInfo,
    VersionManifest,
    check_bounds,
    checksum,
    np_dtype,
)

log = logging.getLogger(__name__)

Box = tuple[int, Bounds]


class Receiver(Protocol):
    """Told of a new version's bytes as they arrive (``ParamServer.receiving``; the relay's
    cut-through, ``service.CutThrough``). Its calls never raise into a publish."""

    def array(self, index: int, data: np.ndarray) -> None:
        """Whole array ``index``'s bytes (uint8), not yet checked against the publisher's."""

    def box(self, part: int, k: int, index: int, bounds: Bounds, data: np.ndarray) -> None:
        """Box ``k`` of part ``part`` (of array ``index``; uint8 C-order bytes), not checked."""

    def checked(self, crcs: Sequence[int] | None) -> None:
        """Every byte arrived, matched the publisher's checksums (each array's, if known) and
        the version is committed."""

    def failed(self, error: BaseException) -> None:
        """The publish failed: nothing received is to be served."""


class PartsServer(Protocol):
    """What an assembly needs of the server that holds it (``server.ParamServer``)."""

    _hot: Any  # the hot ArrayStore

    def _finish_part(
        self,
        assembly: Assembly | None,
        part: int,
        boxes: list[Box],
        values: list[np.ndarray],
        crcs: list[int],
    ) -> tuple[VersionInfo, bool, bool]: ...

    def _commit(
        self, manifest: VersionManifest, prefix: str, chunk_crcs: list[np.ndarray]
    ) -> list[str]: ...


def _volume(bounds: Bounds) -> int:
    return math.prod(hi - lo for lo, hi in bounds)


def _overlap(a: Bounds, b: Bounds) -> bool:
    return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b, strict=True))


def cut(bounds: Bounds) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in bounds)


@dataclasses.dataclass
class Assembly:
    """A version being put together from ``parts`` parts (guarded by the server's lock)."""

    version: int
    step: int
    arrays: tuple[ArraySpec, ...]
    parts: int
    data: list[np.ndarray]
    claimed: dict[int, list[Box]] = dataclasses.field(default_factory=dict)  # part -> its boxes
    done: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # part -> box CRC32Cs
    finishing: bool = False  # the last part is writing the store and committing
    receiver: Receiver | None = None  # told of boxes as they arrive (guarded by nothing: set once)

    @classmethod
    def create(cls, version: int, step: int, arrays: Sequence[ArraySpec], parts: int) -> Assembly:
        data = [np.empty(a.shape, np_dtype(a.dtype)) for a in arrays]
        return cls(version=version, step=step, arrays=tuple(arrays), parts=parts, data=data)

    def claim(self, part: int, boxes: Sequence[Box]) -> None:
        """Records ``part``'s boxes; refuses boxes out of bounds or overlapping another part's."""
        for i, bounds in boxes:
            if not 0 <= i < len(self.arrays):
                raise errors.InvalidArgument(f"part {part}: array index {i} is not in the version")
            check_bounds(self.arrays[i], bounds)
        mine = list(boxes)
        for other, theirs in self.claimed.items():
            if other == part:
                continue
            for i, bounds in mine:
                for j, held in theirs:
                    if i == j and _overlap(bounds, held):
                        raise errors.InvalidArgument(
                            f"part {part}'s box {list(bounds)} of {self.arrays[i].path} overlaps "
                            f"part {other}'s {list(held)}: parts must be disjoint"
                        )
        self.claimed[part] = mine

    def uncovered(self) -> list[str]:
        """Arrays the finished parts do not cover entirely (their boxes being disjoint)."""
        covered = [0] * len(self.arrays)
        for boxes in self.claimed.values():
            for i, bounds in boxes:
                covered[i] += _volume(bounds)
        return [
            f"{a.path} ({c} of {math.prod(a.shape)} elements)"
            for a, c in zip(self.arrays, covered, strict=True)
            if c != math.prod(a.shape)
        ]


class PartSession:
    """Receives one part's boxes (see the module docstring); ``finish`` returns
    (info, already_present, complete)."""

    def __init__(
        self,
        server: PartsServer,
        assembly: Assembly | None,
        part: int,
        boxes: Sequence[Box],
        *,
        committed: tuple[VersionManifest, str] | None,
        arrays: Sequence[ArraySpec],
    ):
        self._server, self._assembly, self.part = server, assembly, part
        self._committed = committed  # a retry after commit: compared with the stored arrays
        self._arrays = tuple(arrays)
        self.boxes = list(boxes)
        self._buffers = [
            np.empty(_volume(b) * np_dtype(self._arrays[i].dtype).itemsize, np.uint8)
            for i, b in self.boxes
        ]
        self._current, self._received, self._crcs, self._crc = 0, 0, [], 0
        self._lock = threading.Lock()

    def add(self, index: int, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        """Bytes [offset, offset + len(data)) of box ``index`` (boxes in order); copied."""
        if not 0 <= index < len(self.boxes) or index < self._current:
            raise errors.InvalidArgument(
                f"part {self.part}: chunk for box {index}: boxes must arrive in order "
                f"0..{len(self.boxes) - 1}, now at {self._current}"
            )
        while self._current < index:
            self._seal()
        buffer = self._buffers[index]
        n = len(data)
        if offset != self._received or offset + n > len(buffer):
            raise errors.InvalidArgument(
                f"part {self.part}: box {index} chunk at offset {offset} of {n} bytes; expected "
                f"offset {self._received} of a {len(buffer)}-byte box"
            )
        view = np.frombuffer(data, np.uint8)
        buffer[offset : offset + n] = view
        self._crc = checksum(view, self._crc)
        self._received += n

    def _seal(self) -> None:
        if self._received != len(self._buffers[self._current]):
            raise errors.DataLoss(
                f"part {self.part}: box {self._current} has {self._received} of "
                f"{len(self._buffers[self._current])} bytes"
            )
        self._crcs.append(self._crc)
        receiver = self._assembly.receiver if self._assembly is not None else None
        if receiver is not None:
            i, bounds = self.boxes[self._current]
            receiver.box(self.part, self._current, i, bounds, self._buffers[self._current])
        self._current, self._received, self._crc = self._current + 1, 0, 0

    def failed(self, error: BaseException) -> None:
        """This part's stream or finish failed: the version is no longer relayed as it arrives
        (a box may be damaged); it is once committed."""
        receiver = self._assembly.receiver if self._assembly is not None else None
        if receiver is not None:
            receiver.failed(error)

    def finish(self, crcs: Sequence[int]) -> tuple[VersionInfo, bool, bool]:
        while self._current < len(self.boxes):
            self._seal()
        if list(crcs) != self._crcs:
            bad = [k for k, (a, b) in enumerate(zip(crcs, self._crcs, strict=False)) if a != b]
            raise errors.DataLoss(f"part {self.part}: checksum mismatch in boxes {bad or 'count'}")
        values = [
            buf.view(np_dtype(self._arrays[i].dtype)).reshape([hi - lo for lo, hi in b])
            for buf, (i, b) in zip(self._buffers, self.boxes, strict=True)
        ]
        if self._committed is not None:
            return self._compare_committed(values)
        return self._server._finish_part(self._assembly, self.part, self.boxes, values, self._crcs)

    def _compare_committed(self, values: list[np.ndarray]) -> tuple[VersionInfo, bool, bool]:
        manifest, prefix = self._committed
        for (i, bounds), value in zip(self.boxes, values, strict=True):
            stored = self._server._hot.read_array(prefix, i, manifest.arrays[i], bounds).result()
            if stored.tobytes() != value.tobytes():
                raise errors.AlreadyExists(
                    f"version {manifest.version} exists with different content in "
                    f"{manifest.arrays[i].path}{list(bounds)}; versions are immutable"
                )
        info = VersionInfo(version=manifest.version, step=manifest.step, nbytes=manifest.nbytes)
        return info, True, True


def commit_assembly(server: PartsServer, assembly: Assembly) -> VersionInfo:
    """Writes a complete assembly to the hot store and commits it (the caller holds no lock)."""
    crcs = [checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a in assembly.data]
    manifest = VersionManifest(
        version=assembly.version,
        step=assembly.step,
        arrays=tuple(
            dataclasses.replace(s, crc32c=c) for s, c in zip(assembly.arrays, crcs, strict=True)
        ),
    )
    prefix = f"v{assembly.version}-{uuid.uuid4().hex[:8]}"
    try:
        writes = [
            server._hot.write_array(prefix, i, s, a)
            for i, (s, a) in enumerate(zip(manifest.arrays, assembly.data, strict=True))
        ]
        tables = [  # while the writes run
            blocks.chunk_checksums(s, a)
            for s, a in zip(manifest.arrays, assembly.data, strict=True)
        ]
        for w in writes:
            w.result()
        doomed = server._commit(manifest, prefix, tables)
    except BaseException:
        server._hot.delete(prefix)
        raise
    for p in doomed:
        server._hot.delete(p)
    return VersionInfo(version=manifest.version, step=manifest.step, nbytes=manifest.nbytes)
