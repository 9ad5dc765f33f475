"""Checksums of a version's storage chunks, so that a sliced pull checks exactly what it reads.

A whole-array pull is checked end to end: the puller compares the array's CRC32C with the one the
publisher sent. A slice cannot be checked that way (its bytes are a strided part of the array),
and checking the whole array on the server for every slice request would make N readers of 1/N of
the model each cost the server a read of all of it. So when a version is committed, the server
records the CRC32C of every chunk of every array (the zarr chunk grid the hot store writes:
codec.chunk_shape, the publisher's shard blocks, which is also what a reader sharded like the
publisher asks for), computed from the bytes it has just checked against the publisher's
checksums. A sliced pull reads the chunks that cover the slice, checks each against its record
(DataLoss names the first that differs), and sends the slice's bytes followed by their CRC32C,
which the puller checks on arrival (client.py). No hop from the publisher to the puller is
unchecked, and the server reads only the chunks a slice touches. (A slice that is a whole array
is checked against the array's own CRC32C instead, in row pieces: server._read_checked.)

A chunk table is uint32[number of chunks], in C order of the chunk grid.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rlax_tpu.param_server import errors
from rlax_tpu.param_server.codec import ArraySpec, Bounds, checksum, chunk_shape, np_dtype

_READ_AHEAD = 2  # bands being read while the one before them is checked and sent
# A chunk's contiguous runs at least this long are checksummed in place, one after the other
# (3x faster than copying the chunk out first); shorter ones cost more in calls than the copy.
_MIN_RUN_BYTES = 4 * 2**10


def grid(spec: ArraySpec) -> tuple[list[int], list[int]]:
    """(chunk shape, chunks per dimension) of an array; both [] for a scalar."""
    chunk = chunk_shape(spec)
    return chunk, [-(-d // c) for d, c in zip(spec.shape, chunk, strict=True)]


def _box(index: Sequence[int], chunk: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(
        slice(k * c, min((k + 1) * c, d)) for k, c, d in zip(index, chunk, shape, strict=True)
    )


def chunk_checksums(spec: ArraySpec, data: np.ndarray) -> np.ndarray:
    """CRC32C of each chunk of ``data`` (an array shaped ``spec.shape``): uint32[n chunks]."""
    chunk, counts = grid(spec)
    table = np.empty(math.prod(counts), np.uint32)
    for k, index in enumerate(itertools.product(*map(range, counts))):
        table[k] = crc_of(data[_box(index, chunk, spec.shape)])
    return table


def crc_of(view: np.ndarray) -> int:
    """CRC32C of the C-order bytes of ``view``, a box of a C-contiguous array."""
    view = np.asarray(view)
    if view.flags.c_contiguous:
        return checksum(view)
    # The view's innermost axes from ``lead`` on are one contiguous run of memory.
    lead = next(k for k in range(view.ndim + 1) if np.asarray(view[(0,) * k]).flags.c_contiguous)
    if view[(0,) * lead].nbytes < _MIN_RUN_BYTES:
        return checksum(np.ascontiguousarray(view))
    crc = 0
    for index in np.ndindex(*view.shape[:lead]):
        crc = checksum(view[index], crc)
    return crc


def read_checked(
    hot: Any,
    prefix: str,
    boxes: Sequence[tuple[int, ArraySpec, Bounds, np.ndarray]],
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Pieces ``(k, byte offset in box k, rows)`` of each box ``(array index, spec, bounds,
    chunk table)`` of a version stored under ``prefix`` in ``hot`` (store.ArrayStore). Each
    piece is the box's rows within one band of chunks along the leading dimension, read with
    the whole chunks that cover it; every chunk is checked against the table first."""
    pending: collections.deque = collections.deque()
    for k, (i, spec, bounds, table) in enumerate(boxes):
        for region, take, offset in _bands(spec, bounds):
            read = hot.read_array(prefix, i, spec, region)
            pending.append((k, i, spec, table, region, take, offset, read))
            if len(pending) > _READ_AHEAD:
                yield _checked(*pending.popleft())
    while pending:
        yield _checked(*pending.popleft())


def _bands(spec: ArraySpec, bounds: Bounds) -> Iterator[tuple[Bounds, tuple[slice, ...], int]]:
    """(region to read: whole chunks, the box's part of it, byte offset of that part in the box)
    per band of chunks along the leading dimension that the box touches."""
    if any(hi <= lo for lo, hi in bounds):
        return  # an empty box has no bytes
    if not bounds:  # a scalar: one chunk
        yield (), (), 0
        return
    chunk, _ = grid(spec)
    outer = [
        (lo // c * c, min(-(-hi // c) * c, d))
        for (lo, hi), c, d in zip(bounds[1:], chunk[1:], spec.shape[1:], strict=True)
    ]
    inner = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(bounds[1:], outer, strict=True))
    row = np_dtype(spec.dtype).itemsize * math.prod(hi - lo for lo, hi in bounds[1:])
    (lo, hi), c = bounds[0], chunk[0]
    for band in range(lo // c, -(-hi // c)):
        a, b = band * c, min((band + 1) * c, spec.shape[0])
        first, last = max(lo, a), min(hi, b)
        yield ((a, b), *outer), (slice(first - a, last - a), *inner), (first - lo) * row


def _checked(
    k: int,
    i: int,
    spec: ArraySpec,
    table: np.ndarray,
    region: Bounds,
    take: tuple[slice, ...],
    offset: int,
    read: Any,
) -> tuple[int, int, np.ndarray]:
    data = np.asarray(read.result())
    chunk, counts = grid(spec)
    first = [lo // c for (lo, _), c in zip(region, chunk, strict=True)]
    spans = [range(-(-(hi - lo) // c)) for (lo, hi), c in zip(region, chunk, strict=True)]
    for local in itertools.product(*spans):
        index = [f + j for f, j in zip(first, local, strict=True)]
        got = crc_of(data[_box(local, chunk, data.shape)])
        want = table[np.ravel_multi_index(index, counts)] if counts else table[0]
        if got != want:
            raise errors.DataLoss(
                f"array {i} ({spec.path}): chunk {tuple(index)} of the stored copy does not match "
                f"the checksum recorded when the version was published"
            )
    return k, offset, np.ascontiguousarray(data[take])
