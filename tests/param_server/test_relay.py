"""Versions relayed worker to worker (param_server/relay.py) over real gRPC on 127.0.0.1: a chain
gets the publisher's bytes exactly, the publisher sends them once, and a relay that dies or
serves a damaged bucket mid-transfer is routed around without anything partial being used."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.relay import (
    Layout,
    Publisher,
    RelayFailed,
    RelayServer,
    fetch,
    fetch_to_device,
)

from .conftest import random_bits, running

BUCKET = 4096


def _arrays(seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """Arrays of mixed dtypes and sizes: some inside a bucket, some across several."""
    rng = np.random.default_rng(seed)
    return [
        ("embed", random_bits(rng, (300, 16), "bfloat16")),  # 9,600 bytes: 3 buckets
        ("norm", random_bits(rng, (7,), "float32")),  # 28 bytes
        ("w", random_bits(rng, (64, 40), "float32")),  # 10,240 bytes
        ("scalar", random_bits(rng, (), "float32")),
    ]


def _same(buffer, arrays) -> None:
    for i, (_, a) in enumerate(arrays):
        got = buffer.array(i)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == a.tobytes()


@pytest.fixture
def servers():
    made: list[RelayServer] = []

    def make(**kw) -> RelayServer:
        made.append(RelayServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def _at_once(calls: list) -> list:
    """Runs every call on a thread of its own, all at once; each one's result or error."""
    out: list = [None] * len(calls)

    def run(k: int) -> None:
        try:
            out[k] = calls[k]()
        except Exception as e:  # noqa: BLE001 - checked by the test
            out[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def _chain(root: RelayServer, relays: list[RelayServer], version: int) -> list:
    """Each relay fetches from the one before it (falling back to all before it, the root last),
    all at once; returns each one's buffer or error."""
    return _at_once(
        [
            functools.partial(
                fetch,
                version,
                [r.endpoint for r in reversed(relays[:k])] + [root.endpoint],
                relays[k],
                timeout_s=60,
            )
            for k in range(len(relays))
        ]
    )


def test_a_chain_gets_the_version_exactly_and_the_publisher_sends_it_once(servers):
    root = servers()
    relays = [servers() for _ in range(3)]
    arrays = _arrays()
    Publisher(root, bucket_bytes=BUCKET).publish(5, arrays)
    buffers = _chain(root, relays, 5)
    layout = Layout.of(arrays, BUCKET)
    for b in buffers:
        assert not isinstance(b, Exception), b
        assert b.complete and b.layout == layout
        _same(b, arrays)
    # The root sent the version once; each relay but the last passed it on once.
    assert root.bytes_sent == layout.total
    assert [r.bytes_sent for r in relays] == [layout.total, layout.total, 0]


def test_a_relay_killed_mid_transfer_is_routed_around(servers):
    arrays = _arrays(1)
    rate = 20_000  # bytes/s each process sends: the ~20 KB version takes about a second a hop
    root = servers(egress_bytes_per_s=rate)
    relays = [servers(egress_bytes_per_s=rate) for _ in range(3)]
    Publisher(root, bucket_bytes=BUCKET).publish(1, arrays)
    killed = threading.Event()

    def kill_when_passed_on() -> None:  # relay 0 dies once relay 1 has a bucket from it
        while not killed.is_set():
            b = relays[1].get(1)
            if b is not None and b.filled >= 1:
                relays[0].stop()
                killed.set()
            time.sleep(0.005)

    killer = threading.Thread(target=kill_when_passed_on)
    killer.start()
    buffers = _chain(root, relays, 1)
    killed.set()
    killer.join()
    for b in buffers[1:]:  # the others finished from another source
        assert not isinstance(b, Exception), b
        _same(b, arrays)
    # Relay 0's server was cut while relay 1 read it: relay 1 went on from the root.
    assert relays[1].bytes_sent > 0 and root.bytes_sent > root.get(1).layout.total


def test_a_failed_source_fails_its_readers_over_and_its_arrays_are_never_handed_out(servers):
    arrays = _arrays(2)
    root = servers(egress_bytes_per_s=20_000)
    middle, last = servers(), servers()
    Publisher(root, bucket_bytes=BUCKET).publish(3, arrays)
    seen: list[str] = []
    t = threading.Thread(
        target=lambda: seen.append(
            fetch(3, [middle.endpoint, root.endpoint], last, on_source=seen.append, timeout_s=60)
        )
    )
    # The middle relay has only the first bucket, then its fetch fails for good.
    partial = _partial_copy(root, middle, 3, buckets=1)
    t.start()
    time.sleep(0.3)
    partial.fail(RuntimeError("its sources are gone"))
    t.join(timeout=60)
    assert seen[:2] == [middle.endpoint, root.endpoint]
    _same(seen[-1], arrays)
    with pytest.raises(RelayFailed, match="its sources are gone"):
        partial.array(len(arrays) - 1)  # never complete: never handed out


def _partial_copy(root: RelayServer, into: RelayServer, version: int, *, buckets: int):
    """``into`` holds ``version``'s first ``buckets`` buckets, copied from ``root``, and waits."""
    from rlax_tpu.param_server.relay import VersionBuffer

    src = root.get(version)
    buffer = VersionBuffer(version, src.layout)
    into.add(buffer)
    for k in range(buckets):
        src.wait(k, 60)
        crc, data = src.bucket(k)
        buffer.put(k, bytes(data), crc)
    return buffer


def test_a_damaged_bucket_is_refused_and_fetched_elsewhere(servers):
    arrays = _arrays(3)
    root, bad, reader = servers(), servers(), servers()
    Publisher(root, bucket_bytes=BUCKET).publish(2, arrays)
    copy = _partial_copy(root, bad, 2, buckets=root.get(2).layout.buckets)
    copy.data[5] ^= 0xFF  # storage damage after the check: its CRC no longer matches
    got = fetch(2, [bad.endpoint, root.endpoint], reader, timeout_s=60)
    _same(got, arrays)


def test_uploads_overlap_the_transfer_and_land_on_the_shardings(servers):
    arrays = _arrays(4)
    root, worker = servers(egress_bytes_per_s=40_000), servers()
    Publisher(root, bucket_bytes=BUCKET).publish(7, arrays)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    shardings = [
        NamedSharding(mesh, P("x") if a.ndim and a.shape[0] % 2 == 0 else P()) for _, a in arrays
    ]
    placed = fetch_to_device(7, [root.endpoint], worker, shardings, timeout_s=60)
    for x, s, (_, a) in zip(placed, shardings, arrays, strict=True):
        assert x.sharding == s
        assert np.asarray(x).tobytes() == a.tobytes()
    with pytest.raises(RelayFailed, match="every source failed"):
        fetch_to_device(8, [root.endpoint], worker, shardings, timeout_s=5)  # no version 8


def test_a_relay_beyond_loopback_needs_a_token():
    with pytest.raises(ValueError, match="needs an auth token"):
        RelayServer("0.0.0.0:0")


@pytest.mark.parametrize(
    "arrays",
    [
        [("a", np.ones(1024, np.float32)), ("empty", np.zeros((0, 3), np.float32))],
        [],
    ],
    ids=["an empty last array at a bucket's end", "no arrays"],
)
def test_edge_layouts_arrive_whole(servers, arrays):
    root, reader = servers(), servers()
    Publisher(root, bucket_bytes=BUCKET).publish(1, arrays)
    got = fetch(1, [root.endpoint], reader, timeout_s=30)
    assert got.complete
    _same(got, arrays)


# -- workers relaying from a real parameter server (param_server.fanout "relay") -----------------


def _tree(seed: int) -> dict:
    """A published tree: bf16 matrices across several 4 MiB buckets, and small f32 leaves."""
    rng = np.random.default_rng(seed)
    return {
        "embed": random_bits(rng, (1024, 3000), "bfloat16"),  # 6 MB
        "layers": [{"w": random_bits(rng, (640, 1024), "bfloat16")} for _ in range(2)],
        "norm": random_bits(rng, (1024,), "float32"),
        "empty": np.zeros((0, 4), np.float32),
    }


def _relayed(ps, tree, relay_server):
    """A worker's weight source over ``relay_server``, falling back to pulls from ``ps``."""
    from rlax_tpu.param_server.client import PulledWeights
    from rlax_tpu.param_server.relay import RelayedWeights

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, tree)
    return RelayedWeights(relay_server, shardings, PulledWeights(ps.client, shardings))


def _chain_of(ps, tree, relays, deltas: bool = True) -> list:
    """A weight source per relay, as the controller wires workers: the worker before, then the
    parameter server (relay_sources); with ``deltas``, at most 7 in a row."""
    out = []
    for k, r in enumerate(relays):
        source = _relayed(ps, tree, r)
        source.deltas = 8 if deltas else 0
        source.sources = (*([relays[k - 1].endpoint] if k else []), ps.endpoint)
        out.append(source)
    return out


def _fetch_all(sources: list, version: int) -> list:
    return _at_once([functools.partial(s.fetch, version) for s in sources])


def _assert_tree_equal(got, want) -> None:
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.asarray(g).tobytes() == w.tobytes()


def test_workers_relay_a_published_version_the_parameter_server_reads_once(ps, servers):
    tree = _tree(0)
    ps.client.push(tree, 1)
    relays = [servers(appear_s=1) for _ in range(3)]
    sources = _chain_of(ps, tree, relays, deltas=False)  # the worker before, then the server
    before = ps.store.bytes_served()
    for got in _fetch_all(sources, 1):
        assert not isinstance(got, Exception), got
        _assert_tree_equal(got, tree)  # the pulled path gives these same bytes
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(tree))
    # The store was read once for the chain, whatever the workers; relays 0 and 1 passed it on.
    assert ps.store.bytes_served() - before == size
    assert [(s.counts["relayed"], s.counts["pulled"]) for s in sources] == [(1, 0)] * 3
    assert relays[0].bytes_sent >= size and relays[1].bytes_sent >= size
    assert relays[2].bytes_sent == 0
    # Without sources (or a version no source has) a worker pulls, and an unknown one is a
    # KeyError (the worker's UnknownVersion).
    sources[2].sources = ()
    _assert_tree_equal(sources[2].fetch(1), tree)
    sources[2].sources = (relays[1].endpoint, ps.endpoint)
    with pytest.raises(KeyError, match="no version 9"):
        sources[2].fetch(9)
    assert (sources[2].counts["relayed"], sources[2].counts["pulled"]) == (1, 2)


def test_a_relaying_worker_killed_mid_transfer_leaves_the_next_one_whole(ps, servers):
    tree = _tree(1)
    ps.client.push(tree, 1)
    # The middle worker sends slowly, so it is cut while the last one reads from it.
    relays = [servers(appear_s=1), servers(egress_bytes_per_s=8e6, appear_s=1), servers(appear_s=1)]
    sources = _chain_of(ps, tree, relays, deltas=False)
    killed = threading.Event()

    def kill_when_passed_on() -> None:
        while not killed.is_set():
            b = relays[2].get(1)
            if b is not None and b.filled >= 1:
                relays[1].stop()
                killed.set()
            time.sleep(0.002)

    killer = threading.Thread(target=kill_when_passed_on)
    killer.start()
    got = _fetch_all(sources, 1)
    killed.set()
    killer.join()
    assert not isinstance(got[2], Exception), got[2]
    _assert_tree_equal(got[2], tree)  # finished from the parameter server, not pulled again
    assert (sources[2].counts["relayed"], sources[2].counts["pulled"]) == (1, 0)
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(tree))
    assert 0 < relays[1].bytes_sent < size  # cut mid-transfer: the rest came from the root


def test_the_root_serves_only_what_matches_the_published_checksums():
    from rlax_tpu.param_server.relay import VersionBuffer, fill_from_pieces

    arrays = _arrays(5)
    layout = Layout.of(arrays, BUCKET)
    pieces = [(k, 0, a) for k, (_, a) in enumerate(arrays)]
    from rlax_tpu.param_server.codec import checksum

    crcs = [checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for _, a in arrays]
    good = VersionBuffer(1, layout)
    fill_from_pieces(good, iter(pieces), crcs)
    _same(good, arrays)
    bad = VersionBuffer(1, layout)
    fill_from_pieces(bad, iter(pieces), [crcs[0], crcs[1] ^ 1, *crcs[2:]])
    assert bad.filled < layout.buckets  # the buckets before the damaged array only
    with pytest.raises(RelayFailed, match="norm fails its checksum"):
        bad.array(len(arrays) - 1)


def _changed(tree: dict, seed: int, fraction: float) -> dict:
    """``tree`` with about ``fraction`` of each array's values replaced: a training step's
    publish, most bf16 values unchanged."""
    rng = np.random.default_rng(seed)

    def change(a: np.ndarray) -> np.ndarray:
        out = a.copy()
        flat = out.reshape(-1)
        if flat.size:
            where = rng.random(flat.size) < fraction
            flat[where] = random_bits(rng, (int(where.sum()),), a.dtype.name)
        return out

    return jax.tree_util.tree_map(change, tree)


def test_a_version_travels_the_chain_as_a_delta_and_is_rebuilt_bitwise(servers):
    with running(ParamServerConfig(chunk_bytes=1 << 20, persist_every=0, relay_deltas=8)) as ps:
        _delta_chain(ps, servers)


def _delta_chain(ps, servers) -> None:
    v1 = _tree(2)
    v2 = _changed(v1, 3, 0.01)
    ps.client.push(v1, 1)
    ps.client.push(v2, 2)
    relays = [servers(appear_s=1) for _ in range(3)]
    sources = _chain_of(ps, v1, relays)
    for got in _fetch_all(sources, 1):  # nothing held: whole
        _assert_tree_equal(got, v1)
    whole = relays[0].get(1).layout.total
    sent_before = relays[0].bytes_sent
    for got in _fetch_all(sources, 2):  # each holds version 1: a delta against it
        assert not isinstance(got, Exception), got
        _assert_tree_equal(got, v2)  # bitwise the full version
    for s in sources:
        assert s.counts["as_deltas"] == 1 and s.counts["pulled"] == 0, s.counts
        assert s.counts["bytes_received"] < whole + whole * 0.05  # v1 whole, then ~2% of it
    # Passed on as a delta too: the first worker sent the second one the delta, not the version.
    delta_bytes = relays[0].get(2, base=1).layout.total
    assert relays[0].bytes_sent - sent_before == delta_bytes < whole * 0.05
    # Each holds version 2 whole afterwards (served on as such to a worker without a base).
    assert relays[2].get(2).complete


def test_whole_versions_when_a_delta_cannot_be_had_or_rebuilt(servers):
    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.param_server.relay import VersionBuffer

    from .conftest import running

    # A worker takes at most one delta in a row (param_server.relay_deltas 2), then a whole one.
    with running(ParamServerConfig(chunk_bytes=1 << 20, persist_every=0, relay_deltas=2)) as ps:
        trees = [_tree(4)]
        for v in range(1, 4):
            trees.append(_changed(trees[-1], v, 0.01))
            ps.client.push(trees[v], v)
        relay = servers(appear_s=1)
        source = _chain_of(ps, trees[0], [relay])[0]
        source.deltas = 2
        _assert_tree_equal(source.fetch(1), trees[1])  # no base: whole
        _assert_tree_equal(source.fetch(2), trees[2])  # against 1
        assert source.counts["as_deltas"] == 1
        _assert_tree_equal(source.fetch(3), trees[3])  # a whole one is due
        assert source.counts["as_deltas"] == 1
        before = ps.store.bytes_served()
        _assert_tree_equal(
            source.fetch(3), trees[3]
        )  # the root serves its buffer again: no new read of its store
        assert ps.store.bytes_served() == before
        # A base that is not what the root encoded against: the rebuilt arrays fail their
        # published checksums, and the whole version is fetched instead.
        other = servers(appear_s=1)
        wrong = VersionBuffer(2, relay.get(2).layout)
        wrong.data[:] = relay.get(2).data
        wrong.data[0] ^= 1
        for k in range(wrong.layout.buckets):
            wrong.fill(k)
        other.add(wrong)
        reader = _chain_of(ps, trees[0], [other])[0]
        _assert_tree_equal(reader.fetch(3), trees[3])
        assert reader.counts["as_deltas"] == 0 and reader.counts["relayed"] == 1
        # A base the root no longer holds (or never had): whole.
        stale = servers(appear_s=1)
        orphan = VersionBuffer(0, relay.get(3).layout)
        orphan.data[:] = 0
        for k in range(orphan.layout.buckets):
            orphan.fill(k)
        stale.add(orphan)
        reader = _chain_of(ps, trees[0], [stale])[0]
        _assert_tree_equal(reader.fetch(3), trees[3])
        assert reader.counts["as_deltas"] == 0


def test_a_silent_source_is_left_after_idle_s(servers):
    """A source that holds the version but sends nothing (a host gone without closing its
    connections looks the same to its reader): the reader leaves it after ``idle_s``."""
    from rlax_tpu.param_server.relay import VersionBuffer

    arrays = _arrays(6)
    root, silent, reader = servers(), servers(), servers()
    Publisher(root, bucket_bytes=BUCKET).publish(4, arrays)
    silent.add(VersionBuffer(4, root.get(4).layout))  # never filled
    tried: list[str] = []
    got = fetch(4, [silent.endpoint, root.endpoint], reader, on_source=tried.append, idle_s=1)
    assert tried == [silent.endpoint, root.endpoint]
    _same(got, arrays)


def test_two_fetches_at_once_on_a_worker_that_keeps_one_version(ps, servers):
    """A staged fetch beside a load (standby.py) on a relay keeping one version, as workers
    run it: each gets its own version whole."""
    trees = [_tree(7), _tree(8)]
    for v, tree in enumerate(trees, start=1):
        ps.client.push(tree, v)
    relay = servers(appear_s=1, keep=1)
    source = _chain_of(ps, trees[0], [relay])[0]
    out = _fetch_all([source, source], 1)
    out2 = _fetch_all([source], 2)
    _assert_tree_equal(out[0], trees[0])
    _assert_tree_equal(out[1], trees[0])
    _assert_tree_equal(out2[0], trees[1])
    both = _fetch_all([source, source], 2) + _fetch_all([source], 1)
    for got, want in zip(both, [trees[1], trees[1], trees[0]], strict=True):
        assert not isinstance(got, Exception), got
        _assert_tree_equal(got, want)
    assert source.counts["pulled"] == 0


def test_the_config_knows_a_relay_message_size():
    from rlax_tpu.config.param_server import RELAY_MESSAGE_BYTES
    from rlax_tpu.param_server.relay import _HEADER, BUCKET_BYTES

    assert BUCKET_BYTES + _HEADER.size == RELAY_MESSAGE_BYTES
    with pytest.raises(ValueError, match="must be >= 4194316 with fanout 'relay'"):
        ParamServerConfig(fanout="relay", max_message_bytes=4 << 20, chunk_bytes=1 << 20)


def test_a_version_buffer_reuses_memory_only_once_nothing_refers_to_it():
    """Buffers come from reused memory (first touches of fresh pages cost more than the transfer
    on the hosts measured), yet arrays jax made from one without a copy keep it from reuse."""
    from rlax_tpu.param_server import relay

    arrays = [("w", np.arange(2**16, dtype=np.float32))]
    layout = Layout.of(arrays)
    first = relay.VersionBuffer(1, layout)
    first.data[: arrays[0][1].nbytes] = arrays[0][1].view(np.uint8)
    for k in range(layout.buckets):
        first.fill(k)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    (on_device,) = relay.to_device(first, [cpu])
    assert first.view(0).ctypes.data % 64 == 0  # aligned: jax may use it without a copy
    del first
    reused = relay._SLABS.reused
    second = relay.VersionBuffer(2, layout)  # the first's memory is still the array's
    second.data[:] = 0xFF
    np.testing.assert_array_equal(np.asarray(on_device), arrays[0][1])
    assert relay._SLABS.reused == reused
    del second, on_device
    relay.VersionBuffer(3, layout)
    assert relay._SLABS.reused == reused + 1


def test_a_relaying_worker_process_killed_mid_transfer_leaves_the_others_whole(ps):
    """Three worker processes in a chain from a real parameter server; the middle one (sending
    slowly) is SIGKILLed once the last has a verified bucket from it: the kernel resets its
    connections, and the last goes on from the parameter server at its first missing bucket.
    Both survivors hold the version bitwise, relayed (not pulled again), nothing partial."""
    import hashlib
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.child_env import child_env

    tree = _tree(2)
    ps.client.push(tree, 1)
    want = hashlib.sha256(b"".join(leaf.tobytes() for leaf in jax.tree_util.tree_leaves(tree)))
    script = Path(__file__).with_name("relay_worker.py")
    rates = (0, 4e6, 0)  # the middle one takes about 2 s for the 8.6 MB version
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), ps.endpoint, str(rate)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for rate in rates
    ]
    try:
        endpoints = [json.loads(p.stdout.readline())["endpoint"] for p in procs]
        for k, p in enumerate(procs):  # as the controller names them: the one before, the server
            sources = [*endpoints[k - 1 : k], ps.endpoint]
            p.stdin.write(json.dumps({"version": 1, "sources": sources}) + "\n")
            p.stdin.flush()
        last = json.loads(procs[2].stdout.readline())
        assert "filled" in last, last  # a bucket from the middle worker, verified
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
        for p in (procs[0], procs[2]):
            while "filled" in (said := json.loads(p.stdout.readline())):
                pass
            assert said.get("sha256") == want.hexdigest(), said
            assert (said["relayed"], said["pulled"]) == (1, 0), said
        procs[2].stdin.close()
        assert procs[2].wait(timeout=30) == 0
        failover = f"relay of version 1 from {endpoints[1]} failed"  # then the parameter server
        assert failover in procs[2].stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)


# -- the root relaying a version while it is published (cut-through) -------------------------


RELAY_PS = ParamServerConfig(chunk_bytes=64 << 10, persist_every=0, fanout="relay", relay_deltas=8)


@pytest.fixture
def relay_ps() -> Iterator:
    """A parameter server whose workers relay (param_server.fanout "relay", deltas on): it
    serves each new version as it arrives."""
    with running(RELAY_PS) as r:
        yield r


def _held(client, gate: threading.Event, *, tamper: bool = False):
    """The client's publish stream, stopped before its trailer until ``gate`` is set; with
    ``tamper``, the first trailer's second checksum flipped."""
    plain, flip = client._publish_stream, [tamper]

    def stream(header, datas):
        *body, trailer = list(plain(header, datas))
        yield from body
        gate.wait()
        if flip[0]:
            flip[0] = False
            trailer.trailer.crc32[1] ^= 1
        yield trailer

    return stream


def _in_thread(call) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _read_while_held(ps, servers, publish, gate: threading.Event) -> tuple:
    """Fetches version 1 from the root while ``publish()`` runs, its held stream released once
    a bucket reached the reader and 0.3 s more passed: (the reader's buffer, its buckets then,
    the fetch's outcome, the publish's)."""
    from rlax_tpu.param_server.relay import FULL, fetch

    pusher, pushed = _in_thread(publish)
    reader = servers()
    fetcher, fetched = _in_thread(lambda: fetch(1, [ps.endpoint], reader, timeout_s=30))
    deadline = time.monotonic() + 30
    while (reader.get(1) is None or reader.get(1).filled < 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)  # nothing more comes while the publish is held
    buffer = reader._versions[(1, FULL)]
    held = buffer.filled
    gate.set()
    pusher.join()
    fetcher.join()
    return buffer, held, fetched[0], pushed[0]


def _assert_holds(buffer, tree) -> None:
    from rlax_tpu.param_server.codec import flatten

    paths, leaves, _ = flatten(tree)
    assert list(buffer.layout.paths) == list(paths)
    for i, leaf in enumerate(leaves):
        assert buffer.array(i).tobytes() == np.asarray(leaf).tobytes()


def test_the_root_relays_a_version_while_it_is_published_and_ends_it_once_checked(
    relay_ps, servers
):
    """Every bucket but the last reaches a reader while the publish is still under way (before
    its trailer, the publisher's checksums); the last comes once they matched. The store is
    never read for it."""
    tree, gate = _tree(3), threading.Event()
    relay_ps.client._publish_stream = _held(relay_ps.client, gate)
    before = relay_ps.store.bytes_served()
    buffer, held, got, pushed = _read_while_held(
        relay_ps, servers, lambda: relay_ps.client.push(tree, 1), gate
    )
    assert not isinstance(pushed, Exception), pushed
    assert 1 <= held < buffer.layout.buckets
    assert got is buffer and buffer.complete
    _assert_holds(buffer, tree)
    assert relay_ps.store.bytes_served() == before


def test_a_version_relayed_in_parts_as_they_arrive_is_whole_once_every_part_is_checked(
    relay_ps, servers
):
    """Two parts (each the half rows of every array), the second held before its trailer: the
    buckets of the arrays both parts have sent are relayed, the last once the second part's
    checksums matched."""
    from rlax_tpu.param_server.codec import ArraySpec, flatten

    tree = {k: v for k, v in _tree(4).items() if k != "empty"}
    paths, leaves, _ = flatten(tree)
    specs = [
        ArraySpec(path=p, shape=a.shape, dtype=a.dtype.name)
        for p, a in zip(paths, leaves, strict=True)
    ]

    def half(part: int) -> list:
        out = []
        for i, a in enumerate(leaves):
            lo, hi = (0, a.shape[0] // 2) if part == 0 else (a.shape[0] // 2, a.shape[0])
            out.append((i, ((lo, hi), *((0, d) for d in a.shape[1:])), a[lo:hi]))
        return out

    gate, client = threading.Event(), relay_ps.client
    plain, held = client._publish_stream, _held(client, gate)

    def publish() -> tuple:
        client.push_part(specs, half(0), 1, part=0, parts=2)
        client._publish_stream = held
        return client.push_part(specs, half(1), 1, part=1, parts=2)

    buffer, filled, got, pushed = _read_while_held(relay_ps, servers, publish, gate)
    client._publish_stream = plain
    assert not isinstance(pushed, Exception) and pushed[1], pushed  # the part completing it
    assert 1 <= filled < buffer.layout.buckets
    assert got is buffer and buffer.complete
    _assert_holds(buffer, tree)


def test_a_publish_that_fails_its_checksums_is_never_completed_by_a_reader(relay_ps, servers):
    """The trailer's second checksum is flipped: the reader holds buckets but never the last,
    and fails (its buffer never whole, so never handed to an engine); the publish is refused,
    and the version published again reaches a new reader whole."""
    from rlax_tpu.param_server import errors
    from rlax_tpu.param_server.relay import RelayFailed, fetch

    tree, gate = _tree(5), threading.Event()
    relay_ps.client._publish_stream = _held(relay_ps.client, gate, tamper=True)
    buffer, held, got, pushed = _read_while_held(
        relay_ps, servers, lambda: relay_ps.client.push(tree, 1), gate
    )
    assert held >= 1 and not buffer.complete
    assert isinstance(got, RelayFailed), got
    assert isinstance(pushed, errors.DataLoss), pushed
    relay_ps.client.push(tree, 1)  # the held stream again, untampered now
    _assert_holds(fetch(1, [relay_ps.endpoint], servers(), timeout_s=30), tree)


def test_a_worker_staging_a_version_being_published_swaps_in_the_relayed_copy(relay_ps, servers):
    """What a worker does when the controller stages a version as its push starts
    (``controller.publishes`` ``stage_early``): its standby fetch relays the buckets while the
    push is held, and the load takes that copy (relayed, never pulled) with the published bytes."""
    from rlax_tpu.inference.standby import Standby

    tree, gate = _tree(6), threading.Event()
    relay_ps.client._publish_stream = _held(relay_ps.client, gate)
    reader = servers(appear_s=1)
    (source,) = _chain_of(relay_ps, tree, [reader], deltas=False)
    standby = Standby(source.fetch)
    pusher, pushed = _in_thread(lambda: relay_ps.client.push(tree, 1))
    standby.stage(1)
    deadline = time.monotonic() + 30
    while (reader.get(1) is None or reader.get(1).filled < 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert reader.get(1).filled >= 1 and not pushed  # buckets here, the push still held
    gate.set()
    pusher.join()
    _assert_tree_equal(standby.take(1), tree)
    assert standby.counts["taken_staged"] == 1
    assert (source.counts["relayed"], source.counts["pulled"]) == (1, 0)


def test_a_reader_never_completes_a_version_from_buckets_of_two_publishes(relay_ps, servers):
    """Replica A takes a publish whose checksums fail (held before its trailer while a reader
    receives its buckets); replica B holds the good version. The reader, failing over from A to
    B, does not resume there on the buckets A sent (they may differ): its fetch fails."""
    from rlax_tpu.param_server.relay import RelayFailed

    tree, gate = _tree(7), threading.Event()
    with running(RELAY_PS) as other:
        other.client.push(tree, 1)
        relay_ps.client._publish_stream = _held(relay_ps.client, gate, tamper=True)
        from rlax_tpu.param_server.relay import fetch

        reader = servers()
        pusher, pushed = _in_thread(lambda: relay_ps.client.push(tree, 1))
        fetcher, fetched = _in_thread(
            lambda: fetch(1, [relay_ps.endpoint, other.endpoint], reader, timeout_s=30)
        )
        deadline = time.monotonic() + 30
        while (reader.get(1) is None or reader.get(1).filled < 1) and time.monotonic() < deadline:
            time.sleep(0.005)
        buffer = reader.get(1)
        assert buffer is not None and buffer.filled >= 1
        gate.set()
        pusher.join()
        fetcher.join()
    assert isinstance(fetched[0], RelayFailed), fetched[0]
    assert "another publish" in str(fetched[0]) and not buffer.complete


def test_a_version_whose_commit_fails_is_never_completed_by_a_reader(relay_ps, servers):
    """Every checksum matches but the store's commit fails: the relay's last bucket waits for
    the commit, so the reader fails rather than hold a version the parameter server never
    committed (its number could be published again with other bytes)."""
    from rlax_tpu.param_server import errors
    from rlax_tpu.param_server.relay import RelayFailed

    def refuse(*args, **kwargs):
        raise errors.DataLoss("the store's commit failed (test)")

    tree, gate = _tree(8), threading.Event()
    relay_ps.client._publish_stream = _held(relay_ps.client, gate)
    relay_ps.store._commit = refuse
    buffer, held, got, pushed = _read_while_held(
        relay_ps, servers, lambda: relay_ps.client.push(tree, 1), gate
    )
    assert isinstance(pushed, errors.DataLoss), pushed
    assert isinstance(got, RelayFailed) and not buffer.complete, got


def test_a_delta_of_a_version_still_arriving_is_refused_at_once(relay_ps, servers):
    """A reader holding version 1 asks for version 2 as a delta while 2 is being pushed: the
    root refuses at once (it would wait for the push to encode it, holding a handler thread),
    and the whole version, relayed as it arrives, is what the reader takes."""
    from rlax_tpu.param_server.relay import RelayFailed, fetch

    relay_ps.client.push(_tree(9), 1)
    tree, gate = _changed(_tree(9), 10, 0.01), threading.Event()
    relay_ps.client._publish_stream = _held(relay_ps.client, gate)
    pusher, _ = _in_thread(lambda: relay_ps.client.push(tree, 2))
    try:
        root = relay_ps.store.receiving.__self__.service  # the relay the parameter server roots
        deadline = time.monotonic() + 30
        while root.get(2) is None and time.monotonic() < deadline:  # version 2 is arriving
            time.sleep(0.005)
        start = time.monotonic()
        with pytest.raises(RelayFailed, match="still arriving"):
            fetch(2, [relay_ps.endpoint], servers(), timeout_s=30, base=1)
        assert time.monotonic() - start < 10
    finally:
        gate.set()
        pusher.join()
