"""A pull pins its version only while it runs: abandoned, cancelled or header-only pulls release
the pin, so GC keeps collecting and later pushes keep succeeding."""

from __future__ import annotations

import time

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.server import ParamServer
from rlax_tpu.rpc import param_server_pb2 as pb
from rlax_tpu.rpc import param_server_pb2_grpc
from rlax_tpu.rpc.transport import make_channel
from tests.param_server.conftest import assert_same_tree, make_tree, running

K = 2
ROUNDS = 20


def wait_unpinned(store: ParamServer, timeout_s: float = 30.0) -> dict[int, int]:
    """Pins left once the server has run its end-of-call callbacks (they run on its threads)."""
    deadline = time.monotonic() + timeout_s
    while store.pins() and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.pins()


def test_sharded_and_abandoned_pulls_release_their_pins():
    config = ParamServerConfig(in_memory_versions=K, chunk_bytes=1000, persist_every=0)
    with running(config) as ps:
        ps.client.push(make_tree(0), 0)
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        shardings = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), make_tree(0))
        channel = make_channel(ps.endpoint)
        stub = param_server_pb2_grpc.ParamServerStub(channel)
        try:
            for _ in range(ROUNDS):
                assert_same_tree(ps.client.pull(0, shardings), make_tree(0))  # header-only first
                stream = stub.Pull(pb.PullRequest(version=0))
                assert next(stream).WhichOneof("part") == "header"
                stream.cancel()  # the client hangs up right after the header
                header_only = stub.Pull(pb.PullRequest(version=0, header_only=True))
                next(header_only)  # and drops a header-only pull without reading its end
                del header_only
            assert wait_unpinned(ps.store) == {}
            for v in range(1, K + 3):  # beyond K: every older version must be collectible
                ps.client.push(make_tree(v), v)
            assert [v.version for v in ps.client.list_versions()[0]] == [K + 1, K + 2]
            committed, stored = ps.store.stored_prefixes()
            assert committed == stored and len(committed) == K
        finally:
            channel.close()


def test_in_process_readers_release_their_pin_when_dropped_or_done():
    store = ParamServer(ParamServerConfig(persist_every=0))
    try:
        store.publish(0, 0, ["x"], [make_tree(0)["embed"]])
        _, unstarted = store.pull(0)
        assert store.pins() == {0: 1}
        del unstarted  # never iterated
        assert store.pins() == {}
        _, half = store.pull(0, piece_bytes=64)
        next(half)
        del half  # abandoned half-way
        assert store.pins() == {}
        _, reader = store.pull(0)
        assert [k for k, _, _ in reader] == [0] and store.pins() == {}  # exhausted
        reader.close()  # closing again is harmless: the pin is not released twice
        _, a = store.pull(0)
        _, b = store.pull(0)
        a.close()
        assert store.pins() == {0: 1}
        b.close()
        assert store.pins() == {}
    finally:
        store.close()
