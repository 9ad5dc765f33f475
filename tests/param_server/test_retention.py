"""GC waits for every replica's progress and for consumers' leases."""

from __future__ import annotations

import threading

import grpc
import jax
import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import errors
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.retention import Retention
from tests.param_server.conftest import assert_same_tree, make_tree, running


def hot(client) -> list[int]:
    return [v.version for v in client.list_versions()[0]]


def test_gc_waits_for_replica_progress_and_leases():
    # This server is replica 0 of 2; replica 1 reports its progress over RPC.
    config = ParamServerConfig(in_memory_versions=2, replicas=2, replica_index=0, persist_every=0)
    with running(config) as ps:
        c = ps.client
        c.push(make_tree(0), 0)
        c.push(make_tree(1), 1)
        with pytest.raises(errors.ResourceExhausted, match=r"replicas \[1\] have not confirmed"):
            c.push(make_tree(2), 2)
        assert hot(c) == [0, 1]

        c.report_progress(1, 1)  # replica 1 holds version 1: version 0 may go
        c.push(make_tree(2), 2)
        assert hot(c) == [1, 2]

        c.lease("worker-7", [1])  # a consumer still needs version 1
        c.report_progress(1, 2)
        with pytest.raises(errors.ResourceExhausted, match="leased by worker-7"):
            c.push(make_tree(3), 3)
        assert hot(c) == [1, 2]
        assert c.list_versions()[0][0].leased_by == ("worker-7",)
        assert_same_tree(c.pull(1), make_tree(1))

        c.lease("worker-7", [])  # released
        c.push(make_tree(3), 3)
        assert hot(c) == [2, 3]
        committed, stored = ps.store.stored_prefixes()
        assert committed == stored and len(committed) == 2  # collected data is gone


def test_lease_on_a_version_not_held_is_refused():
    with running(ParamServerConfig(persist_every=0)) as ps:
        ps.client.push(make_tree(0), 0)
        with pytest.raises(errors.NotFound, match=r"cannot lease versions \[4\]"):
            ps.client.lease("w", [0, 4])
        assert ps.client.list_versions()[0][0].leased_by == ()
        with pytest.raises(errors.InvalidArgument, match="replica 3 is not in"):
            ps.client.report_progress(3, 0)


def test_two_replicas_collect_once_both_hold_the_newer_version():
    configs = [
        ParamServerConfig(in_memory_versions=2, replicas=2, replica_index=r, persist_every=0)
        for r in range(2)
    ]
    with running(configs[0]) as r0, running(configs[1]) as r1:
        both = ParamServerClient([r0.endpoint, r1.endpoint], replica=1)
        for v in range(4):  # push reports every replica's progress to every replica
            both.push(make_tree(v), v)
        assert hot(r0.client) == hot(r1.client) == [2, 3]
        assert_same_tree(both.pull(3), make_tree(3))  # from replica 1
        both.close()


def test_forty_publishes_to_three_replicas_stay_within_in_memory_versions():
    # One trainer publishes to every replica; readers pull from their own replica, with the
    # version they hold leased (as the controller does); memory stays bounded on every replica.
    k, n = 4, 3
    configs = [
        ParamServerConfig(in_memory_versions=k, replicas=n, replica_index=r, persist_every=0)
        for r in range(n)
    ]
    with running(configs[0]) as r0, running(configs[1]) as r1, running(configs[2]) as r2:
        endpoints = [r.endpoint for r in (r0, r1, r2)]
        trainer = ParamServerClient(endpoints)
        readers = [ParamServerClient(endpoints, replica=r) for r in range(n)]
        tree_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(make_tree(0)))
        for v in range(40):
            trainer.push(make_tree(v % 5), v)
            for r, reader in enumerate(readers):
                if v % n == r:  # each replica serves every third version to its reader
                    assert_same_tree(reader.pull(v), make_tree(v % 5))
                    reader.lease(f"reader-{r}", [v])
            for replica in (r0, r1, r2):
                assert len(hot(replica.client)) <= k
        for replica in (r0, r1, r2):
            assert hot(replica.client) == [36, 37, 38, 39]
            committed, stored = replica.store.stored_prefixes()
            assert committed == stored and len(committed) == k  # collected versions' data is gone
            # Only its own reader pulled from it: 40 / 3 versions (rounded by index).
            pulls = len(range(configs.index(replica.store.config), 40, n))
            assert replica.store.bytes_served() == pulls * tree_bytes
        for c in (trainer, *readers):
            c.close()


def test_leases_lapse_after_their_ttl():
    now = [0.0]
    r = Retention(replicas=1, clock=lambda: now[0])
    r.report_progress(0, 5)
    r.set_lease("w", [3], ttl_s=10.0)
    assert r.blocker(3) == "version 3 is leased by w"
    assert r.blocker(4) is None
    assert r.blocker(5) == "replicas [0] have not confirmed progress past version 5"
    now[0] = 9.0
    r.set_lease("w", [3], ttl_s=10.0)  # renewed
    now[0] = 18.0
    assert r.holders(3) == ["w"]
    now[0] = 19.5
    assert r.holders(3) == [] and r.blocker(3) is None
    r.report_progress(0, 2)  # progress never goes back
    assert r.progress() == {0: 5}


def test_a_publish_refused_for_room_waits_until_the_lease_is_released():
    config = ParamServerConfig(in_memory_versions=2, persist_every=0)
    with running(config) as ps:
        waiting = ParamServerClient(ps.endpoint, room_wait_s=60, timeout_s=60)
        impatient = ParamServerClient(ps.endpoint, room_wait_s=0.3, timeout_s=60)
        try:
            waiting.push(make_tree(0), 0)
            waiting.push(make_tree(1), 1)
            ps.client.lease("worker-3", [0])  # version 0 is read, version 1 is the latest
            with pytest.raises(errors.ResourceExhausted, match=r"still refused after 0.3 s"):
                impatient.push(make_tree(2), 2)
            released = threading.Event()

            def release() -> None:
                ps.client.lease("worker-3", [])
                released.set()

            timer = threading.Timer(0.5, release)
            timer.start()
            info = waiting.push(make_tree(2), 2)  # retried until the lease is gone
            timer.join()
            assert released.is_set() and info.version == 2
            assert hot(waiting) == [1, 2]
            assert_same_tree(waiting.pull(2), make_tree(2))
        finally:
            waiting.close()
            impatient.close()


def test_grpcs_own_resource_exhausted_is_not_retried_or_renamed():
    # An oversize message: gRPC says RESOURCE_EXHAUSTED too, but waiting cannot cure it.
    config = ParamServerConfig(chunk_bytes=1000, max_message_bytes=4000, persist_every=0)
    with running(config) as ps:
        client = ParamServerClient(ps.endpoint, chunk_bytes=2**20, room_wait_s=600, timeout_s=60)
        try:
            with pytest.raises(grpc.RpcError) as caught:
                client.push(make_tree(0, scale=64), 0)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not isinstance(caught.value, errors.ParamServerError)
        finally:
            client.close()


def test_a_replicas_progress_counts_only_while_its_lease_runs():
    now = [100.0]
    r = Retention(replicas=3, own=1, replica_lease_s=10.0, clock=lambda: now[0])
    r.report_progress(1, 2)  # this replica's own progress never lapses
    # Replicas never heard of count during the first lease after the start (they may be booting).
    assert r.blocker(1) == "replicas [0, 2] have not confirmed progress past version 1"
    now[0] = 105.0
    r.report_progress(0, 2)
    assert r.blocker(1) == "replicas [2] have not confirmed progress past version 1"
    now[0] = 110.0  # replica 2 was never heard of: it stops counting after one lease
    assert r.counted() == [0, 1] and r.blocker(1) is None
    assert r.blocker(2) == "replicas [0, 1] have not confirmed progress past version 2"
    now[0] = 115.0  # replica 0's report lapsed: it no longer holds GC back
    assert r.counted() == [1]
    assert r.blocker(2) == "replicas [1] have not confirmed progress past version 2"
    r.report_progress(0, 1)  # a report renews the lease; progress never goes back
    assert r.counted() == [0, 1] and r.progress() == {0: 2, 1: 2}
    assert r.blocker(1) is None


def test_a_replica_that_missed_a_version_stops_counting_until_reported_again():
    now = [100.0]
    r = Retention(replicas=3, own=0, replica_lease_s=600.0, clock=lambda: now[0])
    for q in range(3):
        r.report_progress(q, 5)
    r.missed(2)  # the trainer could not commit a version there: its lease ends now
    assert r.counted() == [0, 1] and r.progress() == {0: 5, 1: 5, 2: 5}
    r.missed(0)  # this replica's own progress is what it holds: it never stops counting
    assert r.counted() == [0, 1]
    r.report_progress(2, 7)  # it took a later push: it counts again, for a whole lease
    assert r.counted() == [0, 1, 2]
    now[0] = 800.0
    assert r.counted() == [0]
    with pytest.raises(errors.InvalidArgument, match="replica 3 is not in"):
        r.missed(3)
