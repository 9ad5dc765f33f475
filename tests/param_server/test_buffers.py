"""Version slabs: aligned layout, and memory reused only once nothing references it."""

from __future__ import annotations

import gc
import time

import numpy as np

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.buffers import ALIGN, SlabPool, layout
from tests.param_server.conftest import assert_same_tree, make_tree, running


def test_layout_aligns_every_array():
    offsets, total = layout([3, 0, 64, 65, 1])
    assert offsets == [0, 64, 64, 128, 256] and total == 320
    assert all(o % ALIGN == 0 for o in offsets)


def test_a_slab_is_reused_only_when_nothing_references_it():
    pool = SlabPool(max_idle=1)
    a = pool.take(10_000)
    assert a.ctypes.data % ALIGN == 0 and a.nbytes == 10_000 and a.flags.writeable
    view = a[128:256].view(np.float32)  # what a store or a jax array would keep
    del a
    b = pool.take(10_000)  # the first slab is still referenced through ``view``
    assert pool.reused == 0 and not np.shares_memory(b, view)
    view[:] = 1.0
    b[:] = 0
    assert (view == 1.0).all()
    first = view.ctypes.data - 128
    del view
    gc.collect()
    c = pool.take(10_000)  # now idle: handed out again, same memory
    assert pool.reused == 1 and c.ctypes.data == first
    d = pool.take(20_000)  # another size: a new slab
    assert pool.reused == 1 and d.nbytes == 20_000
    del b, c
    pool.trim()
    assert pool.held() == (2, 1)  # ``d``'s slab, and one idle slab kept for the next version


def test_publishing_past_retention_reuses_collected_memory_and_keeps_versions_intact():
    config = ParamServerConfig(in_memory_versions=2, chunk_bytes=1000, persist_every=0)
    with running(config) as ps:
        for v in range(6):
            ps.client.push(make_tree(v), v)
            assert_same_tree(ps.client.pull(v), make_tree(v))
            if v:
                assert_same_tree(ps.client.pull(v - 1), make_tree(v - 1))  # still hot, intact
        assert ps.store._slabs.reused >= 2  # versions 3.. land in the memory of collected ones
        # TensorStore lets go of a deleted version's data on one of its threads, soon after.
        deadline = time.monotonic() + 10
        while (held := ps.store._slabs.held())[0] - held[1] != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held[0] - held[1] == 2  # the two hot versions; no other memory is held back


def test_a_pull_reuses_memory_only_once_the_caller_dropped_the_previous_arrays(ps):
    ps.client.push(make_tree(0), 0)
    ps.client.push(make_tree(1), 1)
    held = ps.client.pull(0)  # jax arrays that alias the slab on CPU
    for _ in range(4):
        assert_same_tree(ps.client.pull(1), make_tree(1))  # dropped at once: memory reused
        # jax lets go of a host array it aliased at its next call (or a collection); without
        # this a client that drops each version right away alternates between two slabs.
        gc.collect()
    assert ps.client._slabs.reused >= 2
    assert_same_tree(held, make_tree(0))  # never overwritten while held
    _, arrays = ps.client.pull_arrays(0)
    assert all(a.ctypes.data % ALIGN == 0 for a in arrays)


def test_a_pool_gives_idle_slabs_back_after_a_burst():
    pool = SlabPool(max_idle=1)
    burst = [pool.take(10_000) for _ in range(6)]
    assert pool.held() == (6, 0)
    del burst
    gc.collect()
    kept = pool.take(10_000)  # reuses one; the idle ones beyond max_idle are unmapped
    assert pool.reused == 1 and pool.held() == (2, 1)
    kept[:] = 7  # never released while referenced
    assert pool.held() == (2, 1) and (kept == 7).all()


def test_a_client_gives_memory_back_after_a_burst_of_held_pulls(ps):
    ps.client.push(make_tree(0), 0)
    held = [ps.client.pull(0) for _ in range(6)]  # six versions' slabs in use at once
    assert ps.client._slabs.held()[0] == 6
    del held
    gc.collect()
    # Every take unmaps the idle slabs beyond max_idle, so a few pulls after the burst suffice
    # (each gc.collect walks the whole heap: a second here).
    for _ in range(3):
        assert_same_tree(ps.client.pull(0), make_tree(0))
        gc.collect()  # jax lets go of an aliased host array at its next call or a collection
    # The last pull's slab (idle now that it was dropped) and at most max_idle=1 other.
    assert ps.client._slabs.held()[0] <= 2
    ps.client._slabs.trim()
    assert ps.client._slabs.held() == (1, 1)
