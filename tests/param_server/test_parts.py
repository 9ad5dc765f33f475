"""A version published in parts (one per trainer host, each sending the boxes it holds): nothing
is visible until the last part, the parts must be disjoint and cover every array, a retried part
is compared with what was stored, and GC learns of versions completed this way."""

from __future__ import annotations

import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import errors
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.codec import ArraySpec, flatten
from tests.param_server.conftest import assert_same_tree, make_tree, running


def halves(tree: dict) -> tuple[list[ArraySpec], list[list]]:
    """The tree's specs, and two parts: the first and second half of every array's rows."""
    paths, leaves, _ = flatten(tree)
    specs = [
        ArraySpec(path=p, shape=x.shape, dtype=x.dtype.name)
        for p, x in zip(paths, leaves, strict=True)
    ]
    parts: list[list] = [[], []]
    for i, x in enumerate(leaves):
        mid, rest = x.shape[0] // 2, tuple((0, d) for d in x.shape[1:])
        parts[0].append((i, ((0, mid), *rest), x[:mid]))
        parts[1].append((i, ((mid, x.shape[0]), *rest), x[mid:]))
    return specs, parts


def hot(client: ParamServerClient) -> list[int]:
    return [v.version for v in client.list_versions()[0]]


def test_two_parts_make_one_version_visible_only_when_both_arrived(ps):
    tree = make_tree(seed=3)
    specs, parts = halves(tree)
    hosts = [ParamServerClient(ps.endpoint, chunk_bytes=1000) for _ in range(2)]
    try:
        info, complete = hosts[1].push_part(specs, parts[1], 0, part=1, parts=2)
        assert not complete and hot(ps.client) == []
        with pytest.raises(errors.NotFound):
            ps.client.pull(0)
        info, complete = hosts[0].push_part(specs, parts[0], 0, part=0, parts=2)
        assert complete and info.version == 0 and hot(ps.client) == [0]
        assert_same_tree(ps.client.pull(0), tree)
        whole = sum(x.nbytes for x in flatten(tree)[1])
        assert hosts[0].bytes_pushed + hosts[1].bytes_pushed == whole  # nobody sent it all
        assert max(h.bytes_pushed for h in hosts) < whole
        # A retried part is compared with the committed version: same bytes pass, others not.
        assert hosts[0].push_part(specs, parts[0], 0, part=0, parts=2)[1]
        changed = [(i, b, d.copy()) for i, b, d in parts[0]]
        changed[0][2].view("uint8")[0] ^= 1
        with pytest.raises(errors.AlreadyExists, match="immutable"):
            hosts[0].push_part(specs, changed, 0, part=0, parts=2)
        committed, stored = ps.store.stored_prefixes()
        assert committed == stored and len(committed) == 1
    finally:
        for h in hosts:
            h.close()


def test_parts_must_be_disjoint_and_cover_every_array(ps):
    tree = make_tree(seed=4)
    specs, parts = halves(tree)
    ps.client.push_part(specs, parts[0], 0, part=0, parts=2)
    overlapping = [(i, ((lo - 1, hi), *rest), d) for (i, ((lo, hi), *rest), d) in parts[1]]
    with pytest.raises(errors.InvalidArgument, match="overlaps part 0"):
        ps.client.push_part(specs, overlapping[:1], 0, part=1, parts=2)
    with pytest.raises(errors.DataLoss, match="uncovered"):
        ps.client.push_part(
            specs, parts[1][1:], 0, part=1, parts=2
        )  # the first array's half missing
    assert hot(ps.client) == []
    # The failed version's number was never committed: it can be published whole now.
    ps.client.push(tree, 0)
    assert_same_tree(ps.client.pull(0), tree)


def test_versions_published_in_parts_are_collected_on_every_replica():
    configs = [
        ParamServerConfig(in_memory_versions=2, replicas=2, replica_index=r, persist_every=0)
        for r in range(2)
    ]
    with running(configs[0]) as r0, running(configs[1]) as r1:
        hosts = [ParamServerClient([r0.endpoint, r1.endpoint]) for _ in range(2)]
        try:
            for v in range(5):
                tree = make_tree(seed=v)
                specs, parts = halves(tree)
                hosts[v % 2].push_part(specs, parts[0], v, part=0, parts=2)
                hosts[1 - v % 2].push_part(specs, parts[1], v, part=1, parts=2)
            assert hot(r0.client) == hot(r1.client) == [3, 4]
            assert_same_tree(r1.client.pull(4), make_tree(seed=4))
        finally:
            for h in hosts:
                h.close()


def test_a_last_part_refused_for_room_at_commit_completes_the_version_when_retried():
    """The room check of a version in parts passes when its first part opens it; a reader's
    lease taken before the last part arrives refuses the commit. The other part's data is kept,
    the last part's client retries (param_server.publish_room_wait_s) and, the lease released,
    completes the version: nothing is lost while every part's push reported success."""
    import threading

    config = ParamServerConfig(in_memory_versions=2, persist_every=0, chunk_bytes=1000)
    with running(config) as ps:
        hosts = [ParamServerClient(ps.endpoint, chunk_bytes=1000, room_wait_s=60) for _ in range(2)]
        try:
            ps.client.push(make_tree(0), 0)
            ps.client.push(make_tree(1), 1)
            tree = make_tree(seed=2)
            specs, parts = halves(tree)
            assert not hosts[1].push_part(specs, parts[1], 2, part=1, parts=2)[1]
            ps.client.lease("reader", [0])  # version 1 is the latest: no room left
            timer = threading.Timer(0.5, lambda: ps.client.lease("reader", []))
            timer.start()
            info, complete = hosts[0].push_part(specs, parts[0], 2, part=0, parts=2)
            timer.join()
            assert complete and info.version == 2 and hot(ps.client) == [1, 2]
            assert_same_tree(ps.client.pull(2), tree)
        finally:
            for h in hosts:
                h.close()
