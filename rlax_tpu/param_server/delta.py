"""A version as what changed against a version the reader holds, array by array, bitwise.

An update at RL learning rates leaves most values of a bf16 cast unchanged (an Adam step of 1e-5
moves a weight of 0.02 by less than half a bf16 unit in the last place), so a version sent as
its changed values is a small fraction of the whole. Each array is encoded the smallest of four
ways against its base (compared as bits, so NaN payloads, -0 and infinities count exactly):

  same     nothing changed: no bytes;
  entries  the changed elements: their flat indices (uint32, or uint64 past 2**32 elements)
           and new values;
  chunks   the changed runs of ``chunk_bytes``: the chunks' indices and their bytes, for
           updates dense in places;
  full     the new array.

The reader applies the deltas to its copy of the base and checks each result against the CRC32C
of the new array (``DataLoss`` on a mismatch, as for a full pull), so a wrong base or a damaged
delta is never served. This module is the codec and its sizes; ``relay.py`` carries deltas
between the parameter server and the workers.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from rlax_tpu.param_server.codec import checksum, np_dtype
from rlax_tpu.param_server.errors import DataLoss, InvalidArgument

KINDS = ("same", "entries", "chunks", "full")
CHUNK_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class ArrayDelta:
    """One array's change. ``indices``: element indices (entries) or chunk indices (chunks);
    ``values``: the new elements (entries), the chunks' elements in order (chunks, the last
    chunk possibly short), or the whole array (full)."""

    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    chunk_elems: int = 0

    @property
    def nbytes(self) -> int:
        """Payload bytes (indices and values; a header's few bytes not counted)."""
        return sum(a.nbytes for a in (self.indices, self.values) if a is not None)


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of its width (flat, no copy when contiguous)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    return flat.view(np.dtype(f"u{flat.dtype.itemsize}"))


def _index_dtype(n: int) -> np.dtype:
    return np.dtype(np.uint32 if n <= 2**32 else np.uint64)


def encode(base: np.ndarray, new: np.ndarray, *, chunk_bytes: int = CHUNK_BYTES) -> ArrayDelta:
    """``new`` against ``base`` (same shape and dtype), the smallest of the four kinds."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise InvalidArgument(
            f"a delta needs the base's shape and dtype: {base.dtype}{list(base.shape)} vs "
            f"{new.dtype}{list(new.shape)}"
        )
    shape, dtype, size, width = new.shape, new.dtype, new.size, new.dtype.itemsize
    changed = _bits(base) != _bits(new)
    flat_new = np.ascontiguousarray(new).reshape(-1)
    k = int(np.count_nonzero(changed))
    if k == 0:
        return ArrayDelta("same", shape, dtype)
    idx_width = _index_dtype(size).itemsize
    per_chunk = max(1, chunk_bytes // width)
    n_chunks = -(-size // per_chunk)
    padded = np.zeros(n_chunks * per_chunk, bool)
    padded[:size] = changed
    chunk_hit = padded.reshape(n_chunks, per_chunk).any(axis=1)
    hit = np.flatnonzero(chunk_hit)
    last_short = chunk_hit[-1] and size % per_chunk
    chunk_values = len(hit) * per_chunk - (per_chunk - size % per_chunk if last_short else 0)
    costs = {
        "entries": k * (idx_width + width),
        "chunks": len(hit) * idx_width + chunk_values * width,
        "full": size * width,
    }
    kind = min(costs, key=lambda c: (costs[c], KINDS.index(c)))
    if kind == "full":
        return ArrayDelta("full", shape, dtype, values=flat_new.copy())
    if kind == "entries":
        where = np.flatnonzero(changed).astype(_index_dtype(size))
        return ArrayDelta("entries", shape, dtype, indices=where, values=flat_new[where])
    values = np.concatenate([flat_new[c * per_chunk : (c + 1) * per_chunk] for c in hit])
    return ArrayDelta(
        "chunks",
        shape,
        dtype,
        indices=hit.astype(_index_dtype(n_chunks)),
        values=values,
        chunk_elems=per_chunk,
    )


def apply(base: np.ndarray, delta: ArrayDelta) -> np.ndarray:
    """The new array: ``base`` (left untouched) with ``delta`` applied."""
    if base.shape != delta.shape or base.dtype != delta.dtype:
        raise InvalidArgument(
            f"delta for {delta.dtype}{list(delta.shape)} applied to a base of "
            f"{base.dtype}{list(base.shape)}"
        )
    out = np.array(base, copy=True, order="C")
    apply_into(out, delta)
    return out


def apply_into(out: np.ndarray, delta: ArrayDelta) -> None:
    """Applies ``delta`` in place to ``out`` (C-contiguous, holding the base's values)."""
    flat = out.reshape(-1)
    if delta.kind == "full":
        flat[...] = delta.values.reshape(-1)
    elif delta.kind == "entries":
        flat[delta.indices.astype(np.int64)] = delta.values
    elif delta.kind == "chunks":
        at, n = 0, delta.chunk_elems
        for c in delta.indices.astype(np.int64):
            piece = flat[c * n : (c + 1) * n]
            piece[...] = delta.values[at : at + len(piece)]
            at += len(piece)
    elif delta.kind != "same":
        raise InvalidArgument(f"unknown delta kind {delta.kind!r}")


@dataclasses.dataclass(frozen=True)
class TreeDelta:
    """A version's arrays (in manifest order) as deltas against a base version, with the CRC32C
    of each new array."""

    base_version: int
    deltas: tuple[ArrayDelta, ...]
    crcs: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.deltas)

    def kinds(self) -> dict[str, int]:
        """How many arrays went each way."""
        return {k: sum(d.kind == k for d in self.deltas) for k in KINDS}


def encode_tree(
    base: Sequence[np.ndarray],
    new: Sequence[np.ndarray],
    *,
    base_version: int,
    chunk_bytes: int = CHUNK_BYTES,
    crcs: Sequence[int] | None = None,
) -> TreeDelta:
    """Every array of ``new`` against the same-placed one of ``base``, on a few threads (numpy
    lets go of the GIL on large arrays). ``crcs``: the new arrays' CRC32C when known (else
    computed)."""
    if len(base) != len(new):
        raise InvalidArgument(f"the base has {len(base)} arrays, the version {len(new)}")
    with cf.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        deltas = tuple(
            pool.map(lambda bn: encode(*bn, chunk_bytes=chunk_bytes), zip(base, new, strict=True))
        )
        if crcs is None:
            crcs = tuple(pool.map(lambda n: checksum(np.ascontiguousarray(n)), new))
    return TreeDelta(base_version, deltas, tuple(int(c) for c in crcs))


def apply_tree(base: Sequence[np.ndarray], delta: TreeDelta) -> list[np.ndarray]:
    """The version ``delta`` encodes, from ``base`` (the reader's copy of
    ``delta.base_version``); each array checked against its CRC32C (DataLoss: the base is not
    the one encoded against, or the delta was damaged)."""
    out = [np.array(b, copy=True, order="C") for b in base]
    apply_tree_into(out, delta)
    return out


def apply_tree_into(arrays: Sequence[np.ndarray], delta: TreeDelta) -> None:
    """Applies ``delta`` in place to ``arrays`` (C-contiguous, holding the base's values) and
    checks each result against its CRC32C (DataLoss, as for ``apply_tree``; InvalidArgument for
    a delta that does not fit the arrays)."""
    if not len(arrays) == len(delta.deltas) == len(delta.crcs):
        raise InvalidArgument(
            f"the base has {len(arrays)} arrays, the delta {len(delta.deltas)} "
            f"({len(delta.crcs)} checksums)"
        )
    for i, (out, d, crc) in enumerate(zip(arrays, delta.deltas, delta.crcs, strict=True)):
        if out.shape != d.shape or out.dtype != d.dtype:
            raise InvalidArgument(
                f"array {i}: delta for {d.dtype}{list(d.shape)} applied to a base of "
                f"{out.dtype}{list(out.shape)}"
            )
        try:
            apply_into(out, d)
        except (IndexError, ValueError, TypeError, AttributeError) as e:
            raise InvalidArgument(f"array {i}: a malformed {d.kind} delta: {e}") from None
        if checksum(out) != crc:
            raise DataLoss(
                f"array {i} rebuilt from the delta against version {delta.base_version} fails "
                "its checksum (not that base, or a damaged delta)"
            )


def to_payload(delta: TreeDelta) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """``delta`` as arrays to send (``"<i>.indices"``, ``"<i>.values"``) and a JSON-able
    description of the rest (``from_payload`` inverts it)."""
    arrays: list[tuple[str, np.ndarray]] = []
    for i, d in enumerate(delta.deltas):
        if d.indices is not None:
            arrays.append((f"{i}.indices", d.indices))
        if d.values is not None:
            arrays.append((f"{i}.values", d.values))
    meta = {
        "base": delta.base_version,
        "kinds": [d.kind for d in delta.deltas],
        "shapes": [list(d.shape) for d in delta.deltas],
        "dtypes": [d.dtype.name for d in delta.deltas],
        "chunk_elems": [d.chunk_elems for d in delta.deltas],
        "crcs": list(delta.crcs),
    }
    return arrays, meta


def from_payload(meta: dict, arrays: dict[str, np.ndarray]) -> TreeDelta:
    """The TreeDelta that ``to_payload`` gave ``meta`` and ``arrays`` (by name) for."""
    try:
        return _from_payload(meta, arrays)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise InvalidArgument(f"a malformed delta: {type(e).__name__}: {e}") from None


def _from_payload(meta: dict, arrays: dict[str, np.ndarray]) -> TreeDelta:
    deltas = []
    for i, kind in enumerate(meta["kinds"]):
        if kind not in KINDS:
            raise InvalidArgument(f"unknown delta kind {kind!r}")
        deltas.append(
            ArrayDelta(
                kind,
                tuple(meta["shapes"][i]),
                np.dtype(np_dtype(meta["dtypes"][i])),
                indices=arrays.get(f"{i}.indices"),
                values=arrays.get(f"{i}.values"),
                chunk_elems=int(meta["chunk_elems"][i]),
            )
        )
    return TreeDelta(int(meta["base"]), tuple(deltas), tuple(int(c) for c in meta["crcs"]))
