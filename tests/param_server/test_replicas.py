"""Replicas add availability: a push commits on the replicas that are up, a dead replica stops
holding GC back once it misses a push (or after its lease), a returning one recovers and takes the next push, and a pull
fails over to another replica. Real gRPC servers on 127.0.0.1, stopped and restarted for real."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc
import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.param_server import errors
from rlax_tpu.param_server.client import ParamServerClient
from tests.param_server.conftest import (
    assert_lands_sharded,
    assert_same_tree,
    make_tree,
    replicas,
)


def client(reps: list, **kwargs: object) -> ParamServerClient:
    return ParamServerClient([r.endpoint for r in reps], timeout_s=60, **kwargs)


def test_forty_publishes_with_a_replica_down_stay_within_in_memory_versions(caplog):
    k, lease = 4, 0.5
    with replicas(2, in_memory_versions=k, replica_lease_s=lease) as (r0, r1):
        # room_wait_s=0: a single ResourceExhausted fails the push, and the test.
        trainer = client([r0, r1], room_wait_s=0)
        reader = client([r0, r1], replica=1)  # its own replica is the one that dies
        for v in range(k):
            trainer.push(make_tree(v), v)
        assert r0.hot() == r1.hot() == [0, 1, 2, 3]
        r1.stop()
        time.sleep(lease)  # the dead replica's last report lapses: it no longer holds GC back
        tree_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(make_tree(0)))
        caplog.set_level(logging.WARNING, logger="rlax_tpu.param_server.client")
        for v in range(k, k + 40):
            info = trainer.push(make_tree(v % 7), v)
            assert info.version == v
            assert r0.hot() == list(range(max(0, v - k + 1), v + 1))  # only its K hot versions
            committed, stored = r0.store.stored_prefixes()
            assert committed == stored and len(committed) == k  # collected data is gone
            if v % 5 == 0:  # fails over to replica 0: bit-identical weights
                assert_same_tree(reader.pull(v), make_tree(v % 7))
        assert trainer.bytes_pushed == (2 * k + 40) * tree_bytes  # nothing sent to the dead one
        skipped = [m for m in caplog.messages if "skipped the replicas that are down" in m]
        assert len(skipped) == 40 and f"replica 1 at {r1.endpoint}: UNAVAILABLE" in skipped[0]
        assert any(f"replica 1 at {r1.endpoint} failed" in m for m in caplog.messages)
        trainer.close()
        reader.close()


def test_a_replica_that_dies_stops_holding_gc_back_at_the_first_push_it_misses():
    # Its lease (600 s) would outlast the trainer's wait for room (5 s): replica 0 takes every
    # push only because the trainer tells it that replica 1 missed the first one.
    k = 4
    with replicas(2, in_memory_versions=k, replica_lease_s=600.0, publish_room_wait_s=900.0) as (
        r0,
        r1,
    ):
        trainer = client([r0, r1], room_wait_s=5)
        for v in range(k):
            trainer.push(make_tree(v), v)
        r1.stop()
        for v in range(k, k + 40):
            trainer.push(make_tree(v % 7), v)
            assert len(r0.hot()) <= k and trainer.last_replicas == (0,)
        assert r0.hot() == [40, 41, 42, 43]
        # Without a quorum the push fails, naming the replica that is down; nothing changes.
        strict = client([r0, r1], room_wait_s=0, quorum=2)
        with pytest.raises(errors.Unavailable, match=r"1 of 2 replicas answered, 2 needed") as e:
            strict.push(make_tree(0), 44)
        # Also gRPC's UNAVAILABLE, as a lone server that is gone says: callers handle it alike.
        assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert r0.hot()[-1] == 44  # the replica that was up took it; the trainer was told no
        trainer.close()
        strict.close()


def test_a_returning_replica_recovers_and_catches_up(tmp_path):
    # Replica 1 comes back with its persisted versions, and (restarted with a long lease) would
    # wait 600 s for news of its peer before collecting anything: it takes the next push at once
    # because the client tells it how far its peer is. A version it missed is read from the peer.
    k = 4
    with replicas(2, str(tmp_path), in_memory_versions=k, persist_keep=k, replica_lease_s=1.0) as (
        r0,
        r1,
    ):
        trainer = client([r0, r1], room_wait_s=20)
        reader = client([r0, r1], replica=1)
        for v in range(k):
            trainer.push(make_tree(v), v)
        assert r1.store.flush(timeout_s=60)
        r1.stop()
        for v in range(k, k + 6):
            trainer.push(make_tree(v), v)
        r1.config = dataclasses.replace(r1.config, replica_lease_s=600.0, publish_room_wait_s=900.0)
        r1.start()
        assert r1.hot() == [0, 1, 2, 3]  # recovered from its persistence
        # (gRPC reconnects within its backoff, at most 2 s: until then r1 counts as down.)
        trainer.wait_ready(timeout_s=10)
        assert reader.list_versions()[1] == 3
        trainer.push(make_tree(10), 10)
        assert r1.hot() == [1, 2, 3, 10] and r0.hot() == [7, 8, 9, 10]
        assert_same_tree(reader.pull(10), make_tree(10))  # from replica 1 itself
        served = r0.store.bytes_served()
        assert_same_tree(reader.pull(8), make_tree(8))  # missed: read from replica 0
        assert r0.store.bytes_served() > served
        with pytest.raises(errors.NotFound):  # held by no replica
            reader.pull(5)
        # The controller's lease lands where the versions are held.
        assert reader.lease("controller", [8, 9]) > 0
        assert [v.leased_by for v in r0.store.list_versions()][1:3] == [("controller",)] * 2
        trainer.close()
        reader.close()


def test_a_replica_back_but_behind_holds_gc_back_only_until_its_lease_lapses(tmp_path):
    """Replica 0 dies and is back (from its persistence) within its lease on replica 1, having
    missed a version, and cannot take the next one (a reader leases both its versions). Replica
    1, full, must not wait for it: the push it missed ended replica 0's say in GC, and telling
    replica 1 on a retry that replica 0 is at its old version would renew it (a drill's publish
    was refused for 300 s). Replica 1 takes the push; replica 0 refuses it for room."""
    k, lease, wait = 2, 3.0, 10.0
    with replicas(
        2, str(tmp_path), in_memory_versions=k, persist_keep=k, replica_lease_s=lease
    ) as (r0, r1):
        trainer = client([r0, r1], room_wait_s=wait)
        for v in range(k):
            trainer.push(make_tree(v), v)
        assert r0.store.flush(timeout_s=60)
        r0.stop()
        trainer.push(make_tree(2), 2)  # replica 1 alone (replica 0 had confirmed 1 > 0)
        assert r1.hot() == [1, 2] and trainer.last_replicas == (1,)
        r0.start()
        assert r0.hot() == [0, 1]
        pinning = client([r0])
        pinning.lease("reader-0", [0, 1], ttl_s=600)
        trainer.wait_ready(timeout_s=10)
        trainer.push(make_tree(3), 3)
        assert trainer.last_replicas == (1,)
        assert r1.hot() == [2, 3] and r0.hot() == [0, 1]
        trainer.close()
        pinning.close()


def test_a_sharded_pull_fails_over_and_gets_bit_identical_slices():
    tree = make_tree(seed=9, scale=2)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = {
        "embed": NamedSharding(mesh, P("model", None)),
        "layers": [
            {"wq": NamedSharding(mesh, P(None, "model")), "norm": NamedSharding(mesh, P())},
            {"wq": NamedSharding(mesh, P("data", "model")), "norm": NamedSharding(mesh, P())},
        ],
        "head": NamedSharding(mesh, P(None, ("data", "model"))),
    }
    with replicas(3, in_memory_versions=2) as reps:
        trainer = client(reps)
        trainer.push(tree, 0)
        reps[2].stop()
        readers = [client(reps, replica=r) for r in range(3)]
        got = readers[2].pull(0, shardings)  # replica 2 is down: replica 0 serves it
        assert_lands_sharded(got, shardings, tree)
        assert reps[0].store.bytes_served() > 0 and reps[1].store.bytes_served() == 0
        # Every pull starts at its own replica again: back up (and reconnected: each client has
        # its own channels, which retry within their 2 s backoff), replica 2 serves its reader.
        reps[2].start()
        for c in (trainer, readers[2]):
            c.wait_ready(timeout_s=10)
        trainer.push(make_tree(1, scale=2), 1)
        assert_same_tree(readers[2].pull(1), make_tree(1, scale=2))
        assert reps[2].store.bytes_served() > 0
        for c in (trainer, *readers):
            c.close()


def test_a_start_goes_on_with_a_quorum_of_replicas_up(caplog):
    """wait_ready (the controller's start) waits for every replica, then goes on with the ones
    that answered if they make the quorum, naming the silent one; below the quorum it raises."""
    from rlax_tpu.rpc.transport import ComponentUnreachable

    with replicas(2) as reps:
        reps[1].stop()
        with caplog.at_level(logging.WARNING, logger="rlax_tpu.param_server.client"):
            client(reps).wait_ready(timeout_s=0.5)
        down = reps[1].endpoint
        assert any(
            f"param_server at {down} did not answer" in r.getMessage() for r in caplog.records
        )
        with pytest.raises(ComponentUnreachable, match=down):
            client(reps, quorum=2).wait_ready(timeout_s=0.5)


def test_a_replica_that_refuses_a_push_is_left_out_like_one_that_is_down(caplog):
    # Replica 1 has no room: of its 2 hot versions one is the latest and the other leased by a
    # reader there, so it refuses version 2 (ResourceExhausted after room_wait_s); replica 0
    # takes it. With a quorum of 1 that commits the version; with 2 the refusal is the answer.
    lease = 1.0
    with replicas(2, in_memory_versions=2, replica_lease_s=lease) as (r0, r1):
        trainer = client([r0, r1], room_wait_s=0.2)
        for v in range(2):
            trainer.push(make_tree(v), v)
        pinning = client([r1])
        pinning.lease("reader-1", [0])  # on replica 1 alone
        caplog.set_level(logging.WARNING, logger="rlax_tpu.param_server.client")
        info = trainer.push(make_tree(2), 2)
        assert info.version == 2 and trainer.last_replicas == (0,)
        assert r0.hot() == [1, 2] and r1.hot() == [0, 1]
        skipped = [m for m in caplog.messages if "skipped the replicas" in m]
        assert len(skipped) == 1
        assert f"replica 1 at {r1.endpoint}: RESOURCE_EXHAUSTED" in skipped[0]
        assert "leased by reader-1" in skipped[0] and "still refused after 0.2 s" in skipped[0]
        reader = client([r0, r1], replica=1)
        assert_same_tree(reader.pull(2), make_tree(2))  # replica 1 lacks it: read from replica 0
        assert r0.store.bytes_served() > 0 and r1.store.bytes_served() == 0
        strict = client([r0, r1], room_wait_s=0.2, quorum=2)
        with pytest.raises(errors.ResourceExhausted, match="leased by reader-1"):
            strict.push(make_tree(2), 2)
        # Left out of the holders, replica 1 stops holding GC back on replica 0 once its last
        # report lapses, as a dead replica does.
        time.sleep(lease)
        trainer.push(make_tree(3), 3)
        assert r0.hot() == [2, 3] and r1.hot() == [0, 1]
        for c in (trainer, pinning, reader, strict):
            c.close()


def test_a_refusal_that_says_the_call_is_wrong_fails_a_push_that_a_quorum_took(tmp_path):
    with replicas(2) as (r0, r1):
        trainer = client([r0, r1])
        trainer.push(make_tree(0), 0)
        with pytest.raises(errors.AlreadyExists, match="different content"):
            trainer.push(make_tree(1), 0)  # other content for version 0, on both replicas
        # Version 1 is on replica 1 alone; other content for it is new to replica 0, which takes
        # it, but two contents under one number is the caller's error, whatever the quorum.
        only_r1 = client([r1])
        only_r1.push(make_tree(1), 1)
        with pytest.raises(errors.AlreadyExists, match="different content"):
            trainer.push(make_tree(2), 1)
        assert r0.hot() == [0, 1]
        # Credentials replica 1 refuses (gRPC's PERMISSION_DENIED, not the store's) say so too.
        token = tmp_path / "publish-token"
        token.write_text("secret\n")
        r1.stop()
        r1.config = dataclasses.replace(r1.config, publish_token_file=str(token))
        r1.start()
        without_token = client([r0, r1])
        with pytest.raises(grpc.RpcError) as e:
            without_token.push(make_tree(2), 2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert r0.hot() == [0, 1, 2]
        for c in (trainer, only_r1, without_token):
            c.close()
