"""The engine on a device mesh (``inference.mesh``) against the single-device engine, on the 8
forced CPU devices: same greedy tokens on ragged requests, log-probs to f32 round-off (a sharded
matmul sums its halves in another order), weights and KV pages laid out by the logical rules."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import MeshConfig
from rlax_tpu.inference.engine import Engine, engine_mesh
from rlax_tpu.models.paged_cache import page_bytes
from tests.child_env import child_env
from tests.conftest import free_port

from .conftest import (
    SMALL,
    assert_same_samples,
    by_key,
    mixed_requests,
    random_requests,
    run_with_an_overlapped_reload,
)

MESHES = {
    "tensor2": MeshConfig(data=1, fsdp=1, tensor=2),
    "data2xtensor2": MeshConfig(data=2, fsdp=1, tensor=2),
    "tensor4": MeshConfig(data=1, fsdp=1, tensor=4),  # 2 KV heads: pages replicated
}
CFG = dataclasses.replace(SMALL, max_concurrent_seqs=8)


def _greedy(engine: Engine) -> dict:
    for r in random_requests(32, seed=5, temperature=0.0):
        engine.submit(r)
    return by_key(engine.run())


@pytest.fixture(scope="module")
def single(tiny_model):
    engine = Engine(tiny_model, CFG)
    assert engine.mesh is None
    return _greedy(engine)


@pytest.mark.parametrize("name", MESHES)
def test_sharded_engine_gives_the_single_device_greedy_tokens(tiny_model, single, name, caplog):
    """Also: a tensor degree that does not divide the KV heads is said at start-up with its cost
    (tensor 4 over 2 KV heads: each device holds the whole cache, not a quarter)."""
    with caplog.at_level(logging.WARNING, logger="rlax_tpu.inference.engine"):
        engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=MESHES[name]))
    replicated = [r.getMessage() for r in caplog.records if "KV heads" in r.getMessage()]
    if name == "tensor4":
        whole = sum(x.nbytes for x in jax.tree.leaves(engine.cache) if x.ndim == 5) / 2**20
        assert len(replicated) == 1, replicated
        assert f"whole KV cache ({whole:.1f} MiB) instead of 1/4 of it" in replicated[0]
    else:
        assert replicated == []
    assert engine.mesh is not None and engine.mesh.size == MESHES[name].data * MESHES[name].tensor
    got = _greedy(engine)
    assert got.keys() == single.keys() and len(got) == 32
    for key, want in single.items():
        np.testing.assert_array_equal(got[key].tokens, want.tokens, err_msg=str(key))
        # Greedy log-probs are log-softmax at the picked token: f32 round-off of a sharded sum.
        np.testing.assert_allclose(got[key].logprobs, want.logprobs, rtol=0, atol=2e-5)


def test_preemption_prefix_sharing_and_seeded_sampling_on_a_mesh(tiny_model):
    """data 2 x tensor 2 under a page budget of one max-length sequence and spares (per data
    shard: each shard has a pool of its own, the single-device engine the one): a group of 4
    samples shares its prompt's pages (copy-on-write), sequences are preempted and recomputed,
    and seeded temperature-1 samples are the single-device engine's (log-probs to f32 round-off,
    up to a near-tie drawn the other way); greedy rows give the same tokens."""
    requests = mixed_requests(sampled=10, greedy=4)
    budget = 16 * page_bytes(tiny_model.cfg, CFG.page_size)
    runs = []
    for mesh in (None, MESHES["data2xtensor2"]):
        cfg = dataclasses.replace(CFG, kv_cache_bytes=budget * (1 if mesh is None else mesh.data))
        engine = Engine(tiny_model, cfg if mesh is None else dataclasses.replace(cfg, mesh=mesh))
        for r in requests:
            engine.submit(r)
        runs.append((by_key(engine.run()), engine))
    (want, _), (got, sharded) = runs
    assert sharded.mesh is not None
    assert sharded.scheduler.num_preemptions > 0 and sharded.stats().pages_shared > 0
    assert got.keys() == want.keys()
    for key, ro in want.items():
        assert_same_samples(got[key], ro, bitwise=False, atol=2e-5)
        if key[0].startswith("greedy"):
            np.testing.assert_array_equal(got[key].tokens, ro.tokens)
    assert len(want) == 10 * 2 + 4 + 4


def test_weights_and_pages_follow_the_logical_rules(tiny_model):
    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=MESHES["data2xtensor2"]))
    mlp = engine.state["layers"][0]["mlp"]["up_proj"][...]
    assert mlp.sharding.spec == P(None, "tensor")  # [embed, mlp]: columns over tensor
    # [L, Hkv, P, ...]: KV heads over tensor, pages by data shard
    assert engine.cache.k_pages.sharding.spec == P(None, "tensor", "data")
    shard = engine.cache.k_pages.addressable_shards[0].data.shape
    assert shard[1:3] == (engine.cache.k_pages.shape[1] // 2, engine.cache.k_pages.shape[2] // 2)
    wide = Engine(tiny_model, dataclasses.replace(CFG, mesh=MESHES["tensor4"]))
    assert wide.cache.k_pages.sharding.is_fully_replicated  # 2 KV heads do not split 4 ways


def test_reloaded_weights_land_on_the_mesh(tiny_model):
    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=MESHES["tensor2"]))
    params = jax.tree.map(np.asarray, engine.state)  # host copies
    engine.load_weights(1, params)
    assert engine.state["layers"][0]["mlp"]["up_proj"][...].sharding.spec == P(None, "tensor")
    engine.submit(random_requests(1, seed=9, temperature=0.0)[0])
    assert len(engine.run()) == 1 and engine.version == 1


def test_a_pull_lands_in_the_engines_shardings(tiny_model):
    """A version pulled from a real parameter server with the engine's weight shardings arrives
    already laid out as the engine serves it: loading it moves nothing."""
    from flax import nnx

    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.param_server.client import ParamServerClient, PulledWeights
    from rlax_tpu.param_server.service import serve

    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=MESHES["data2xtensor2"]))
    server, port, store = serve(ParamServerConfig(persist_every=0))
    client = ParamServerClient(f"127.0.0.1:{port}")
    try:
        client.push(jax.tree.map(np.asarray, nnx.to_pure_dict(engine.state)), 1)
        pulled = PulledWeights(client, engine.weight_shardings()).fetch(1)
        want = jax.tree.leaves(engine.weight_shardings())
        assert [x.sharding for x in jax.tree.leaves(pulled)] == want
        engine.load_weights(1, pulled)
        for got, fetched in zip(
            jax.tree.leaves(engine.state), jax.tree.leaves(pulled), strict=True
        ):
            assert got is fetched  # placed as pulled: no copy, no resharding
    finally:
        client.close()
        server.stop(None)
        store.close()


def test_a_mesh_larger_than_the_worker_is_refused():
    cfg = dataclasses.replace(CFG, mesh=MeshConfig(data=1, fsdp=1, tensor=16))
    with pytest.raises(ValueError, match="inference.mesh needs 16 devices"):
        engine_mesh(cfg, jax.devices())
    assert engine_mesh(CFG) is None


def test_a_sharded_engine_keeps_its_layout_and_never_recompiles_in_steady_state(tiny_model):
    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=MESHES["data2xtensor2"]))
    for r in random_requests(6, seed=11, num_samples=3):
        engine.submit(r)
    engine.run()
    warm = engine.compilations
    for r in random_requests(8, seed=12, num_samples=3):
        engine.submit(r)
    engine.run()
    assert engine.compilations == warm
    assert engine.cache.k_pages.sharding.spec == P(None, "tensor", "data")  # donated and kept


@pytest.mark.slow
def test_an_engine_spanning_two_processes_gives_the_same_tokens(tiny_model, tmp_path):
    """A worker over two hosts: two jax.distributed processes (gloo on 127.0.0.1, 4 CPU devices
    each) run one engine on a data 2 x tensor 4 mesh across both, each following the same calls
    (with a reload overlapped under running requests: two weight versions in its steps); the
    greedy tokens equal the one-device engine's, log-probs to f32 round-off (cross-process sums
    go through gloo)."""
    worker = Path(__file__).with_name("distributed_engine.py")
    coordinator, out = f"127.0.0.1:{free_port()}", tmp_path / "tokens.json"
    env = child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), coordinator, str(pid), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    engine = Engine(tiny_model, dataclasses.replace(SMALL, overlap_reload=True))
    want = {r.prompt_id: r for r in run_with_an_overlapped_reload(engine)}
    assert len(want) == 11 and {int(r.versions[-1]) for r in want.values()} == {0, 1}
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log[-3000:]
    got = json.loads(out.read_text())
    assert got.keys() == want.keys()
    for key, r in want.items():
        assert got[key]["tokens"] == r.tokens.tolist(), key
        np.testing.assert_allclose(got[key]["logprobs"], r.logprobs, rtol=0, atol=2e-5)
