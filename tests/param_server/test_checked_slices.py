"""Every pull is checked, sliced ones included: the server checks the chunks a slice reads against
the checksums it recorded at commit, the client checks the slice's bytes against the checksum the
server sends after them. Corruption is made for real: in the server's hot store, and on the wire
by a server that flips a bit after checksumming what it sends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import blocks, errors
from rlax_tpu.param_server.client import ParamServerClient, needed_slices
from rlax_tpu.param_server.framing import ChunkView
from rlax_tpu.param_server.server import ParamServer
from rlax_tpu.param_server.service import ParamServerService, add_to_server
from rlax_tpu.rpc.transport import make_server
from tests.param_server.conftest import random_bits, replicas, same_bits

MESH_SHAPE = (2, 4)


def sharded_tree(seed: int) -> tuple[dict, dict, dict]:
    """(host tree, the same as jax arrays sharded over 8 CPU devices, the shardings): "w" is
    stored as a 2 x 4 grid of (32, 8) chunks, the publisher's shard blocks."""
    rng = np.random.default_rng(seed)
    host = {"w": random_bits(rng, (64, 32), "float32"), "b": random_bits(rng, (32,), "bfloat16")}
    mesh = jax.make_mesh(MESH_SHAPE, ("data", "model"))
    shardings = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P())}
    return host, jax.device_put(host, shardings), shardings


def corrupt(store: ParamServer, version: int, path: str, at: tuple[int, ...]) -> None:
    """Flips one bit of element ``at`` of array ``path`` in the server's hot store."""
    manifest, prefix = store._index[version]
    i = [a.path for a in manifest.arrays].index(f'["{path}"]')
    box = tuple((x, x + 1) for x in at)
    view = store._hot._view(prefix, i, manifest.arrays[i], box)
    value = np.asarray(view.read().result()).copy()
    value.view(np.uint8).reshape(-1)[0] ^= 1
    view.write(value).result()


def test_a_sliced_pull_detects_a_chunk_corrupted_in_the_store(ps):
    host, tree, shardings = sharded_tree(1)
    ps.client.push(tree, 0)
    manifest = ps.client._manifest(0, 0)
    w = next(a for a in manifest.arrays if a.path == '["w"]')
    assert w.shard_shape == (32, 8) and blocks.grid(w) == ([32, 8], [2, 4])
    corrupt(ps.store, 0, "w", (40, 17))  # chunk (1, 2)

    # A process whose devices hold rows 32..64 (a host of a multi-host worker) pulls 4 column
    # tiles of them: the server checks the chunks it reads and finds the corrupted one.
    mesh = shardings["w"].mesh
    lower, upper = (needed_slices(manifest, shardings, devices=row) for row in mesh.devices)
    with pytest.raises(errors.DataLoss, match=r'\["w"\]\): chunk \(1, 2\) of the stored copy'):
        ps.client.pull_arrays(0, upper)
    with pytest.raises(errors.DataLoss, match="chunk"):  # just the corrupted element
        ps.client.pull_arrays(0, [(1, ((40, 41), (17, 18)))])
    # Slices that touch only intact chunks still pull (the check is per chunk, not per array).
    _, got = ps.client.pull_arrays(0, lower)
    for (i, bounds), x in zip(lower, got, strict=True):
        want = host["w"] if manifest.arrays[i].path == '["w"]' else host["b"]
        assert same_bits(x, want[tuple(slice(lo, hi) for lo, hi in bounds)])
    # This process's devices need all of "w": one whole box, checked against the manifest.
    with pytest.raises(errors.DataLoss, match=r'array 1 \(\["w"\]\) of the stored copy'):
        ps.client.pull(0, shardings)
    with pytest.raises(errors.DataLoss, match=r'checksum mismatch in \[\'\["w"\]\'\]'):
        ps.client.pull(0)  # a whole pull: the client's check against the manifest
    assert ps.store.pins() == {}  # the failed pulls released the version


def test_a_corrupted_replica_is_failed_over_to_an_intact_one():
    host, tree, shardings = sharded_tree(2)
    with replicas(2) as (r0, r1):
        trainer = ParamServerClient([r0.endpoint, r1.endpoint], timeout_s=60)
        trainer.push(tree, 0)
        corrupt(r0.store, 0, "w", (3, 30))
        got = trainer.pull(0, shardings)  # replica 0's copy fails its check: replica 1 serves
        for x, want in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(host), strict=True
        ):
            for shard in x.addressable_shards:
                assert same_bits(np.asarray(shard.data), want[shard.index])
        assert r1.store.bytes_served() == sum(a.nbytes for a in host.values())
        trainer.close()


class FlipsABit(ParamServerService):
    """Sends the first data chunk of a pull with one bit flipped, after checksumming it: the
    corruption a faulty NIC or proxy would make on the wire."""

    def _stream(self, *args: object) -> Iterator:
        flipped = False
        for message in super()._stream(*args):
            if isinstance(message, ChunkView) and len(message.data) and not flipped:
                data = bytearray(message.data)
                data[-1] ^= 0x10
                message, flipped = message._replace(data=memoryview(bytes(data))), True
            yield message


class DropsTheTrailer(ParamServerService):
    """Sends a sliced pull without the checksums that end it (a truncated stream)."""

    def _stream(self, *args: object) -> Iterator:
        for message in super()._stream(*args):
            if isinstance(message, ChunkView) or message.WhichOneof("part") != "trailer":
                yield message


@contextlib.contextmanager
def serving(service_class: type) -> Iterator[ParamServerClient]:
    store = ParamServer(ParamServerConfig(chunk_bytes=1000, persist_every=0))
    service = service_class(store, chunk_bytes=1000)
    server, port = make_server("127.0.0.1:0", lambda s: add_to_server(service, s))
    client = ParamServerClient(f"127.0.0.1:{port}", chunk_bytes=1000, timeout_s=60)
    try:
        yield client
    finally:
        client.close()
        server.stop(None)
        store.close()


def test_a_bit_flipped_on_the_wire_fails_a_sliced_pull():
    host, tree, shardings = sharded_tree(3)
    with serving(FlipsABit) as client:
        client.push(tree, 0)
        manifest = client._manifest(0, 0)
        with pytest.raises(errors.DataLoss, match="checksum mismatch in"):
            client.pull(0, shardings)
        upper = shardings["w"].mesh.devices[1]  # tiles, read as checked chunks on the server
        boxes = needed_slices(manifest, shardings, devices=upper)
        with pytest.raises(errors.DataLoss, match="checksum mismatch in"):
            client.pull_arrays(0, boxes)
        with pytest.raises(errors.DataLoss, match="checksum mismatch in"):
            client.pull(0)


def test_a_sliced_pull_without_its_checksums_is_refused():
    _, tree, shardings = sharded_tree(4)
    with serving(DropsTheTrailer) as client:
        client.push(tree, 0)
        with pytest.raises(errors.DataLoss, match="without a checksum per slice"):
            client.pull(0, shardings)
        client.pull(0)  # a whole pull is checked against the manifest, and has no trailer
