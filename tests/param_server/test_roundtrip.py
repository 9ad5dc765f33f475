"""Publish/pull through a real server: bit-exact f32 and bf16, idempotent retries, sliced pulls."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.codec import flatten
from rlax_tpu.param_server.server import ParamServer
from tests.param_server.conftest import (
    assert_lands_sharded,
    assert_same_tree,
    make_tree,
    same_bits,
)


def test_round_trip_is_bit_exact_for_f32_and_bf16(ps):
    tree = make_tree(seed=1)
    info = ps.client.push(tree, 0)
    assert (info.version, info.step) == (0, 0)
    assert info.nbytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    got = ps.client.pull(0)
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(got)} == {"float32", "bfloat16"}
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(got))
    assert_same_tree(got, tree)


def test_jax_arrays_round_trip_and_latest_is_the_newest(ps):
    tree = make_tree(seed=2)
    ps.client.push(tree, 3, step=7)
    ps.client.push(jax.tree_util.tree_map(jax.numpy.asarray, make_tree(seed=4)), 5)
    versions, latest = ps.client.list_versions()
    assert [(v.version, v.step) for v in versions] == [(3, 7), (5, 5)] and latest == 5
    assert_same_tree(ps.client.pull(), make_tree(seed=4))
    assert_same_tree(ps.client.pull(3), tree)


def test_identical_retry_is_idempotent(ps):
    tree = make_tree(seed=3)
    ps.client.push(tree, 1)
    ps.client.push(tree, 1)  # the controller may retry a push whose reply was lost
    versions, _ = ps.client.list_versions()
    assert [v.version for v in versions] == [1]
    assert_same_tree(ps.client.pull(1), tree)
    committed, stored = ps.store.stored_prefixes()
    assert committed == stored and len(committed) == 1


def test_sliced_pull_builds_sharded_arrays_from_only_the_needed_slices(ps):
    tree = make_tree(seed=5, scale=2)
    ps.client.push(tree, 0)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = {
        "embed": NamedSharding(mesh, P("model", None)),  # rows over 4 devices, replicated x2
        "layers": [
            {"wq": NamedSharding(mesh, P(None, "model")), "norm": NamedSharding(mesh, P())},
            {"wq": NamedSharding(mesh, P("data", "model")), "norm": NamedSharding(mesh, P())},
        ],
        "head": NamedSharding(mesh, P(None, ("data", "model"))),  # columns over all 8
    }
    before, served = ps.client.bytes_pulled, ps.store.bytes_served()
    got = ps.client.pull(0, shardings)
    # Devices holding the same slice share one pull: replicated data is not fetched twice.
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    assert ps.client.bytes_pulled - before == ps.store.bytes_served() - served == total
    assert_lands_sharded(got, shardings, tree)
    for x, want in zip(
        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tree), strict=True
    ):
        assert same_bits(np.asarray(x), want)


def test_slice_requests_return_exactly_the_boxes(ps):
    tree = make_tree(seed=6)
    ps.client.push(tree, 0)
    paths, leaves, _ = flatten(tree)
    head = paths.index('["head"]')
    boxes = [(head, ((0, 16), (8, 24))), (head, ((3, 5), (0, 64))), (0, ((60, 64), (0, 1)))]
    before = ps.client.bytes_pulled
    manifest, arrays = ps.client.pull_arrays(0, boxes)
    assert ps.client.bytes_pulled - before == sum(a.nbytes for a in arrays)  # only the boxes
    assert [a.path for a in manifest.arrays] == paths
    for (i, bounds), got in zip(boxes, arrays, strict=True):
        want = leaves[i][tuple(slice(lo, hi) for lo, hi in bounds)]
        assert same_bits(got, want)


def test_the_store_keeps_its_own_bytes_not_the_callers():
    # The hot store references the arrays it is handed instead of copying them: an in-process
    # publish must hand it a copy, so the caller may reuse its buffers.
    store = ParamServer(ParamServerConfig(persist_every=0))
    try:
        small, big = np.arange(6, dtype=np.float32), np.arange(3 << 20, dtype=np.float32)
        store.publish(0, 0, ["s", "b"], [small, big])
        small[:], big[:] = -1, -1
        _, reader = store.pull(0)
        pieces = list(reader)
        got = [np.concatenate([p.reshape(-1) for k, _, p in pieces if k == i]) for i in (0, 1)]
        assert same_bits(got[0], np.arange(6, dtype=np.float32))
        assert same_bits(got[1], np.arange(3 << 20, dtype=np.float32))
    finally:
        store.close()


def test_edge_shapes_round_trip_whole_and_sliced(ps):
    # A scalar, empty arrays, rows wider than a chunk (a piece bigger than the read buffers),
    # and a long vector spanning many chunks, through the reused read buffers and the slabs.
    rng = np.random.default_rng(7)
    tree = {
        "scalar": np.float32(3.5),
        "empty": np.zeros((0, 16), np.float32),
        "empty_bf16": np.zeros((4, 0), ml_dtypes.bfloat16),
        "wide": rng.standard_normal((3, 600), dtype=np.float32),
        "long": rng.standard_normal(5000, dtype=np.float32).astype(ml_dtypes.bfloat16),
    }
    ps.client.push(tree, 0)
    assert_same_tree(ps.client.pull(0), {k: np.asarray(v) for k, v in tree.items()})
    paths = [a.path for a in ps.client._manifest(0, 0).arrays]
    boxes = [
        (paths.index('["wide"]'), ((1, 3), (7, 599))),
        (paths.index('["long"]'), ((17, 4999),)),
        (paths.index('["empty"]'), ((0, 0), (3, 9))),
    ]
    _, got = ps.client.pull_arrays(0, boxes)
    assert same_bits(got[0], tree["wide"][1:3, 7:599])
    assert same_bits(got[1], tree["long"][17:4999])
    assert got[2].shape == (0, 6)
