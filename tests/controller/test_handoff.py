"""Versions handed from the trainer to the workers device to device, against a real parameter
server on 127.0.0.1: the same arrays as a pull, placed as asked, with nothing pulled over gRPC
for the versions held, and the server still getting every version."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.controller.handoff import DeviceHandoff
from rlax_tpu.param_server.client import PulledWeights
from tests.param_server.conftest import make_tree, running


def _placed(tree: dict, devices: list, spec: P) -> dict:
    """``tree`` on a 1-D mesh over ``devices``, leaves of 2+ dims split by ``spec``."""
    mesh = Mesh(np.array(devices), ("x",))
    return jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, spec if a.ndim >= 2 else P())), tree
    )


def _shardings(tree: dict) -> dict:
    return jax.tree.map(lambda a: a.sharding, tree)


class _Counting:
    """The fallback source, counting the versions it was asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def fetch(self, version: int):
        self.asked.append(version)
        return self.inner.fetch(version)


@pytest.fixture
def ps():
    with running(ParamServerConfig(chunk_bytes=1000, persist_every=0)) as r:
        yield r


def test_a_held_version_equals_the_pulled_one_without_touching_the_server(ps):
    devices = jax.devices()
    assert len(devices) == 8
    # The trainer's cast on devices 0-3 split by rows; the engine's on 4-7 split by columns.
    target = _shardings(_placed(make_tree(9), devices[4:], P(None, "x")))
    handoff = DeviceHandoff(ps.client, keep=2)
    try:
        for v in (1, 2, 3):
            handoff.push(_placed(make_tree(v), devices[:4], P("x")), v)
        pulled = PulledWeights(ps.client, target)
        fallback = _Counting(pulled)
        source = handoff.source(target, fallback)
        assert handoff.held() == [2, 3]  # keep=2: the newest two
        for v in (2, 3):
            got = source.fetch(v)
            assert fallback.asked == []  # held: nothing asked of the parameter server
            handoff.flush(v)  # the reference pull bypasses the hand-off: its copy first
            want = pulled.fetch(v)  # the same version over gRPC
            for a, b, s in zip(
                jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(target), strict=True
            ):
                assert a.sharding == s  # placed where the engine asked
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(
                    np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
                )
        # Version 1 is no longer held: it comes from the parameter server, which got every version.
        old = source.fetch(1)
        assert fallback.asked == [1]
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(make_tree(1)), strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8))
        assert handoff.counts == {"device_loads": 2, "server_loads": 1, "copies": 3}
        hot, _ = handoff.port(ps.client).list_versions()
        assert [i.version for i in hot] == [1, 2, 3]
    finally:
        handoff.close()


def test_the_trainer_waits_for_the_copy_before_a_second_version_in_flight(ps):
    """max_pending=1: a push while the previous version's copy is still under way waits for it."""
    gate, started = threading.Event(), threading.Event()

    class Gated:  # the real client, its push held until the test opens the gate
        def push(self, params, version):
            started.set()
            gate.wait(timeout=60)
            return ps.client.push(params, version)

    handoff = DeviceHandoff(Gated(), keep=1, max_pending=1)
    try:
        handoff.push(make_tree(1), 1)
        assert started.wait(timeout=60)
        second = threading.Thread(target=handoff.push, args=(make_tree(2), 2))
        second.start()
        second.join(timeout=0.5)
        assert second.is_alive()  # held back: version 1 is still being copied
        assert handoff.held() == [1]
        gate.set()
        second.join(timeout=60)
        assert not second.is_alive()
        handoff.flush()
        assert [i.version for i in ps.client.list_versions()[0]] == [1, 2]
    finally:
        gate.set()
        handoff.close()


def test_a_failed_copy_is_raised_by_the_next_push_and_by_flush(ps):
    ps.client.push(make_tree(1), 1)
    handoff = DeviceHandoff(ps.client, keep=1)
    try:
        handoff.push(make_tree(2), 1)  # other content for a version the server has
        with pytest.raises(RuntimeError, match="copying version 1 to the parameter server failed"):
            handoff.flush()
        with pytest.raises(RuntimeError, match="copying version 1 to the parameter server failed"):
            handoff.push(make_tree(3), 3)
        handoff.flush(0)  # a version that did not fail is not blamed for it
    finally:
        handoff.close()


def test_bad_sizes_are_refused(ps):
    with pytest.raises(ValueError, match="keep"):
        DeviceHandoff(ps.client, keep=0)


def _copying_version_1(ps):  # noqa: ANN001, ANN202
    """Version 0 on the server, version 1 pushed to a hand-off whose copy to the server waits
    for the returned gate: (gate, hand-off, its port)."""
    gate = threading.Event()

    class Gated:
        def push(self, params, version):
            gate.wait(timeout=60)
            return ps.client.push(params, version)

    ps.client.push(make_tree(0), 0)
    handoff = DeviceHandoff(Gated(), keep=1)
    handoff.push(make_tree(1), 1)
    return gate, handoff, handoff.port(ps.client)


def test_a_lease_of_a_version_still_being_copied_lands_with_its_copy(ps):
    gate, handoff, port = _copying_version_1(ps)
    try:
        port.lease("controller", [0, 1])  # 1 is not on the server yet: no error
        assert ps.store.list_versions()[0].leased_by == ("controller",)  # 0 leased at once
        gate.set()
        handoff.flush()  # the deferred lease runs before the copy counts as done
        leased = {v.version: v.leased_by for v in ps.store.list_versions()}
        assert leased == {0: ("controller",), 1: ("controller",)}
    finally:
        gate.set()
        handoff.close()


def test_consumers_leases_wait_for_copies_apart_and_an_empty_set_releases(ps):
    """The controller's and an evaluation's leases of a version still being copied both land
    (one waiting call per consumer, not one in all); an evaluation that ends before the copy
    lands releases at once, and its waiting lease is dropped, not applied after."""
    gate, handoff, port = _copying_version_1(ps)
    try:
        port.lease("controller", [1])
        port.lease("evaluation", [0, 1])
        port.lease("ended", [1])
        port.lease("ended", [])
        assert ps.store.list_versions()[0].leased_by == ("evaluation",)
        gate.set()
        handoff.flush()
        leased = {v.version: set(v.leased_by) for v in ps.store.list_versions()}
        assert leased == {0: {"evaluation"}, 1: {"controller", "evaluation"}}
        port.lease("evaluation", [])
        leased = {v.version: set(v.leased_by) for v in ps.store.list_versions()}
        assert leased == {0: set(), 1: {"controller"}}
    finally:
        gate.set()
        handoff.close()


def test_a_closed_hand_off_refuses_pushes_instead_of_hanging(ps):
    handoff = DeviceHandoff(ps.client, keep=1)
    handoff.close()
    with pytest.raises(RuntimeError, match="closed"):
        handoff.push(make_tree(1), 1)
    handoff.flush(1)  # returns: nothing will ever copy it
