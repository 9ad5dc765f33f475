"""Manifests, pytree paths and chunk layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.param_server import errors
from rlax_tpu.param_server.codec import (
    ArraySpec,
    VersionManifest,
    checksum,
    chunk_shape,
    describe_sharding,
    flatten,
    normalize_index,
    unflatten_nested,
)


def test_paths_name_leaves_and_rebuild_nested_trees():
    tree = {"b": [np.zeros(2), {"w": np.ones(3)}], "a": np.zeros(())}
    paths, leaves, _ = flatten(tree)
    assert paths == ['["a"]', '["b", 0]', '["b", 1, "w"]']
    rebuilt = unflatten_nested(paths, leaves)
    assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(tree)


def test_manifest_json_round_trip():
    m = VersionManifest(
        version=3,
        step=4,
        arrays=(
            ArraySpec(path='["w"]', shape=(2, 3), dtype="bfloat16", crc32c=7, shard_shape=(1, 3)),
        ),
    )
    assert VersionManifest.from_json(m.to_json()) == m
    assert m.nbytes == 12


def test_specs_reject_what_cannot_be_stored():
    with pytest.raises(errors.InvalidArgument, match="unsupported dtype 'object'"):
        ArraySpec(path="x", shape=(1,), dtype="object")
    with pytest.raises(errors.InvalidArgument, match="negative dimension"):
        ArraySpec(path="x", shape=(-1,), dtype="float32")


def test_chunks_follow_the_writers_sharding_and_stay_bounded():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(np.zeros((8, 32), np.float32), NamedSharding(mesh, P(None, "model")))
    desc, block = describe_sharding(x)
    assert block == (8, 8) and '"spec": [null, "model"]' in desc
    spec = ArraySpec(path="x", shape=(8, 32), dtype="float32", shard_shape=block)
    assert chunk_shape(spec) == [8, 8]
    big = ArraySpec(path="e", shape=(49152, 576), dtype="float32")
    chunk = chunk_shape(big)
    assert np.prod(chunk) * 4 <= 16 * 2**20 and chunk[1] == 576


def test_jax_indices_become_bounds():
    assert normalize_index((slice(None), slice(2, 4)), (5, 6)) == ((0, 5), (2, 4))
    assert normalize_index((), (3,)) == ((0, 3),)


def test_checksums_are_crc32c_and_extend_chunk_by_chunk():
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    data = np.arange(1000, dtype=np.float32)
    whole = checksum(data)
    raw = data.view(np.uint8)
    assert checksum(memoryview(raw[700:]), checksum(raw[:700])) == whole
    assert checksum(bytes(raw)) == whole and checksum(np.zeros(0, np.uint8)) == 0
