"""What a version is made of: array specs, the manifest, pytree paths, checksums, slices.

A version is a list of arrays in a fixed order. Each array has a key path in the publisher's pytree
(JSON: ``["layers", 0, "w"]`` for ``tree["layers"][0]["w"]``), a shape, a
dtype, the CRC32C of its C-order bytes and a description of the sharding it was written with.

Checksums are CRC32C (``google-crc32c``: hardware-accelerated, ~3x zlib's crc32 here, and it
releases the GIL on large buffers), on both sides of every transfer and on disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import google_crc32c
import jax
import ml_dtypes
import numpy as np

from rlax_tpu.param_server.errors import InvalidArgument

DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    }
)
# Chunks of the zarr arrays stay near this size: big enough for throughput, small enough that a
# sliced pull does not decode much more than it needs.
# Per-dimension [lo, hi) of a box of an array.
Bounds = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionInfo:
    """A stored version as the server reports it."""

    version: int
    step: int
    nbytes: int
    persisted: bool = False
    leased_by: tuple[str, ...] = ()


TARGET_CHUNK_BYTES = 16 * 2**20
# The most dimensions an array may have (TensorStore's limit).
MAX_RANK = 32


def np_dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {name!r}; supported: {', '.join(sorted(DTYPES))}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArraySpec:
    """One array of a version. ``shard_shape`` is the writer's per-device block (() = whole)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    crc32c: int = 0
    sharding: str = '{"kind": "host"}'
    shard_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        np_dtype(self.dtype)
        if len(self.shape) > MAX_RANK:
            raise InvalidArgument(
                f"array {self.path}: rank {len(self.shape)} is more than the {MAX_RANK} dimensions "
                f"supported (shape {self.shape})"
            )
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"array {self.path}: negative dimension in shape {self.shape}")
        if self.shard_shape and len(self.shard_shape) != len(self.shape):
            raise InvalidArgument(
                f"array {self.path}: shard_shape {self.shard_shape} does not match shape {self.shape}"
            )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize

    def same_layout(self, other: ArraySpec) -> bool:
        return (self.path, self.shape, self.dtype) == (other.path, other.shape, other.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionManifest:
    """Everything needed to read a version back; written last, so it doubles as commit marker.

    ``checksum`` names the algorithm of the arrays' ``crc32c`` values: "crc32c", or "crc32"
    (zlib) for a manifest persisted before the switch to CRC32C, read back for recovery only.
    """

    version: int
    step: int
    arrays: tuple[ArraySpec, ...]
    checksum: str = "crc32c"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> VersionManifest:
        raw = json.loads(data)
        legacy = any("crc32" in a for a in raw["arrays"])  # zlib crc32, before CRC32C
        arrays = tuple(
            ArraySpec(
                path=a["path"],
                shape=tuple(a["shape"]),
                dtype=a["dtype"],
                crc32c=a["crc32" if legacy else "crc32c"],
                sharding=a["sharding"],
                shard_shape=tuple(a["shard_shape"]),
            )
            for a in raw["arrays"]
        )
        checksum = "crc32" if legacy else raw.get("checksum", "crc32c")
        return cls(version=raw["version"], step=raw["step"], arrays=arrays, checksum=checksum)


def checksum(data: np.ndarray | bytes | memoryview, crc: int = 0) -> int:
    """CRC32C of C-order bytes, continuing from ``crc`` (the checksum of the bytes before)."""
    if not isinstance(data, np.ndarray):
        data = np.frombuffer(data, np.uint8)  # google_crc32c takes arrays, not memoryviews
    return google_crc32c.extend(crc, as_bytes(data))


def as_bytes(data: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (bfloat16 included), no copy."""
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


# ------------------------------------------------------------------------------------ pytrees


def _key(k: Any) -> str | int:
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return k.key
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    key = getattr(k, "key", k)
    return key if isinstance(key, int | str) else str(key)


def path_string(key_path: Sequence[Any]) -> str:
    """JSON list of the keys (str) and indices (int) leading to a leaf; the leaf's identity."""
    return json.dumps([_key(k) for k in key_path])


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) of a pytree, in jax's flattening order."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [path_string(p) for p, _ in with_paths], [x for _, x in with_paths], treedef


def unflatten_nested(paths: Sequence[str], leaves: Sequence[Any]) -> Any:
    """Rebuilds nested dicts (dict keys and attributes) and lists (sequence indices) from paths."""
    if len(paths) == 1 and json.loads(paths[0]) == []:
        return leaves[0]
    root: dict = {}
    for path, leaf in zip(paths, leaves, strict=True):
        node, keys = root, json.loads(path)
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [_lists(node[i]) for i in range(len(node))]
    return {k: _lists(v) for k, v in node.items()}


# ------------------------------------------------------------------------------------ shardings


def describe_sharding(x: Any) -> tuple[str, tuple[int, ...]]:
    """(JSON description, per-device block shape) of the sharding an array lives in."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return json.dumps({"kind": "host"}), ()
    shape = tuple(x.shape)
    block = tuple(sharding.shard_shape(shape))
    if isinstance(sharding, jax.sharding.NamedSharding):
        desc = {
            "kind": "named",
            "mesh": dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True)),
            "spec": [list(p) if isinstance(p, tuple) else p for p in sharding.spec],
        }
    else:
        desc = {"kind": type(sharding).__name__, "devices": len(sharding.device_set)}
    return json.dumps(desc), () if block == shape else block


def chunk_shape(spec: ArraySpec) -> list[int]:
    """Zarr chunk grid: the writer's shard block, halved along its largest dim while too big."""
    chunk = list(spec.shard_shape or spec.shape) or []
    if not chunk:
        return []
    chunk = [max(1, c) for c in chunk]
    itemsize = np_dtype(spec.dtype).itemsize
    while math.prod(chunk) * itemsize > TARGET_CHUNK_BYTES and max(chunk) > 1:
        i = chunk.index(max(chunk))
        chunk[i] = (chunk[i] + 1) // 2
    return chunk


# ------------------------------------------------------------------------------------ slices


def normalize_index(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """((start, stop), ...) of a per-device index as jax gives it (slices with None bounds)."""
    out = []
    for dim, s in zip(
        shape, tuple(index) + (slice(None),) * (len(shape) - len(index)), strict=True
    ):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise InvalidArgument(f"strided index {s} is not supported")
        out.append((start, stop))
    return tuple(out)


def check_bounds(spec: ArraySpec, bounds: Sequence[tuple[int, int]]) -> None:
    if len(bounds) != len(spec.shape) or any(
        not 0 <= lo <= hi <= dim for (lo, hi), dim in zip(bounds, spec.shape, strict=False)
    ):
        raise InvalidArgument(f"slice {list(bounds)} is out of bounds of {spec.path} {spec.shape}")
