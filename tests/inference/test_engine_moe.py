"""A mixture-of-experts model in the engine: its log-probs are the trainer's replay (bitwise
where the engine's start-up check finds rows independent) and its greedy tokens the uncached
forward's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import MeshConfig
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.models.paged_cache import page_bytes

from .conftest import by_key, make_engine, random_requests
from .test_engine import _run_checked, assert_greedy, assert_the_replay


@pytest.fixture(scope="module")
def moe_model() -> models.Transformer:
    cfg = models.preset(
        "tiny", arch="qwen3_moe", qk_norm=True, num_experts=4, expert_intermediate_size=96
    )
    return models.init_model(cfg)


def test_logprobs_are_the_replay_and_greedy_tokens_the_forwards(moe_model):
    engine = make_engine(moe_model, prefill_rows=2, prefill_len=3)
    for r in random_requests(4, num_samples=2, temperature=0.8):
        engine.submit(r)
    assert_the_replay(moe_model, engine, _run_checked(engine), temperature=0.8)

    greedy = make_engine(moe_model)
    for r in random_requests(3, seed=1, temperature=0.0):
        greedy.submit(r)
    forward = jax.jit(models.forward)
    for ro in _run_checked(greedy):
        p, n = len(ro.prompt_tokens), len(ro.tokens)
        seq = np.zeros((1, 48), np.int32)
        seq[0, : p + n] = [*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]
        logits = forward(moe_model, jnp.asarray(seq))[0, p - 1 : p + n - 1]
        assert_greedy(ro.tokens, np.asarray(logits), tol=1e-5)


def _own_routes(model: models.Transformer, rollouts) -> list[np.ndarray]:
    """The experts the uncached forward's router picks at each position of each rollout's
    sequence, [S, L, k] each: one causal forward over them all, padded at the end (which no
    earlier position sees)."""
    seqs = [[*ro.prompt_tokens.tolist(), *ro.tokens.tolist()] for ro in rollouts]
    width = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def experts(state, tokens):  # noqa: ANN001, ANN202
        m = nnx.merge(graphdef, state)
        return m.run(tokens, models.default_positions(tokens), models.NoCache())[2].experts

    got = np.asarray(experts(state, batch))  # [L, B, S, k]
    return [got[:, i, : len(s)].swapaxes(0, 1) for i, s in enumerate(seqs)]


def test_the_engine_records_the_experts_of_every_position_it_computed(moe_model):
    # Prompts through the prefill program (chunks of 3 over 2 rows) and through decode rows,
    # groups of 2 forked from a shared prompt.
    engine = make_engine(moe_model, prefill_rows=2, prefill_len=3)
    for r in random_requests(5, num_samples=2, temperature=1.0):
        engine.submit(r)
    rollouts = _run_checked(engine)
    cfg = moe_model.cfg
    agree = total = 0
    for ro, own in zip(rollouts, _own_routes(moe_model, rollouts), strict=True):
        n = len(ro.prompt_tokens) + len(ro.tokens)
        assert ro.routes.shape == (n, cfg.num_layers, cfg.experts_per_token)
        assert ro.routes.dtype == np.int16
        # The last token was sampled, never fed: nothing routed it.
        assert (ro.routes[-1] == -1).all() and (ro.routes[:-1] >= 0).all()
        own = own[:-1]
        # Another program (the uncached forward) agrees but where f32 round-off reorders two
        # near-equal router probabilities; top-k is a set, so compare sorted.
        agree += int((np.sort(own, -1) == np.sort(ro.routes[:-1], -1)).all(-1).sum())
        total += own.shape[0] * own.shape[1]
    assert agree >= 0.99 * total


def test_routes_survive_preemption_and_come_with_kept_pages(moe_model):
    requests = random_requests(6, seed=3, num_samples=2, temperature=1.0)
    roomy = make_engine(moe_model)
    for r in requests:
        roomy.submit(r)
    want = by_key(roomy.run())
    starved = make_engine(moe_model, kv_cache_bytes=16 * page_bytes(moe_model.cfg, 4))
    for r in requests:
        starved.submit(r)
    got = by_key(_run_checked(starved))
    assert starved.scheduler.num_preemptions > 0
    for key, ro in want.items():
        if starved.rows_bitwise:  # recomputed positions route as the first time, bit for bit
            np.testing.assert_array_equal(got[key].routes, ro.routes)

    # A continuation that takes a finished sample's kept pages takes their routes too: its
    # sequence's routes are the ones recomputing every position gives.
    first = dataclasses.replace(requests[0], num_samples=1)
    results, reused = [], []
    for keep in (True, False):
        engine = make_engine(moe_model)
        engine.submit(dataclasses.replace(first, keep_pages=keep))
        [ro] = engine.run()
        engine.submit(
            Request(
                prompt_id="next",
                prompt_tokens=tuple(ro.prompt_tokens.tolist()),
                continuation=(*ro.tokens.tolist(), 9, 10),
                sampling=dataclasses.replace(first.sampling, max_new_tokens=4),
            )
        )
        [nxt] = engine.run()
        results.append(nxt)
        reused.append(engine.stats().prefix_tokens_reused)
    assert reused[0] > 0 and reused[1] == 0
    kept, recomputed = results
    assert kept.routes.shape == recomputed.routes.shape
    assert (kept.routes[:-1] >= 0).all()
    if engine.rows_bitwise:
        np.testing.assert_array_equal(kept.routes, recomputed.routes)


def test_routes_cross_the_wire_exactly(moe_model):
    from rlax_tpu.inference.service import rollout_from_pb, rollout_to_pb

    engine = make_engine(moe_model)
    engine.submit(random_requests(1, seed=4, temperature=1.0)[0])
    [ro] = engine.run()
    back = rollout_from_pb(rollout_to_pb(ro))
    assert back.routes.dtype == np.int16
    np.testing.assert_array_equal(back.routes, ro.routes)
    dense = dataclasses.replace(ro, routes=None)
    assert rollout_from_pb(rollout_to_pb(dense)).routes is None
    msg = rollout_to_pb(ro)
    msg.routes = msg.routes[:-2]
    with pytest.raises(ValueError, match="bytes do not hold int16"):
        rollout_from_pb(msg)


@pytest.mark.parametrize(
    "mesh",
    [
        MeshConfig(data=1, fsdp=1, expert=4, tensor=1),
        MeshConfig(data=2, fsdp=1, expert=2, tensor=2),
    ],
    ids=["expert4", "data2-expert2-tensor2"],
)
def test_an_expert_parallel_engine_samples_the_single_devices_tokens(moe_model, mesh):
    """Experts split over the engine's expert axis (each device runs its own on every row of a
    step and the group sums them): the greedy tokens and the recorded experts of one device."""
    requests = random_requests(6, seed=5, num_samples=2, temperature=0.0)
    runs = []
    for cfg in (None, mesh):
        engine = make_engine(moe_model, **({} if cfg is None else {"mesh": cfg}))
        for r in requests:
            engine.submit(r)
        runs.append(by_key(_run_checked(engine)))
    assert engine.mesh is not None and engine.mesh.shape["expert"] == mesh.expert
    gate = engine.state["layers"][0]["mlp"]["gate_proj"][...]
    assert gate.addressable_shards[0].data.shape[0] == moe_model.cfg.num_experts // mesh.expert
    single, sharded = runs
    assert single.keys() == sharded.keys()
    for key, ro in single.items():
        np.testing.assert_array_equal(sharded[key].tokens, ro.tokens)
        np.testing.assert_array_equal(sharded[key].routes, ro.routes)
        np.testing.assert_allclose(sharded[key].logprobs, ro.logprobs, atol=1e-5)


def test_the_trainers_forward_forced_to_the_recorded_routes_takes_the_engines_experts(moe_model):
    """What routing replay rests on: the recorded routes, forced in a full-sequence forward
    (the trainer's), are exactly the experts that forward uses at every recorded position, and
    its log-probs are the engine's (to f32 round-off: another program)."""
    from rlax_tpu.trainer.logprobs import completion_logprobs

    engine = make_engine(moe_model, prefill_rows=2, prefill_len=3)
    for r in random_requests(4, seed=6, num_samples=2, temperature=1.0):
        engine.submit(r)
    rollouts = _run_checked(engine)
    width = max(len(ro.tokens) for ro in rollouts)
    length = max(len(ro.prompt_tokens) + len(ro.tokens) for ro in rollouts)
    cfg = moe_model.cfg
    tokens = np.zeros((len(rollouts), length), np.int32)
    positions = np.full((len(rollouts), length), -1, np.int32)
    routes = np.full((len(rollouts), length, cfg.num_layers, cfg.experts_per_token), -1, np.int16)
    targets = np.zeros((len(rollouts), width), np.int32)
    for i, ro in enumerate(rollouts):
        n = len(ro.prompt_tokens) + len(ro.tokens)
        tokens[i, :n] = [*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]
        positions[i, :n] = np.arange(n)
        routes[i, :n] = ro.routes
        targets[i, : len(ro.tokens)] = ro.tokens
    prompt = np.array([len(ro.prompt_tokens) for ro in rollouts], np.int32)
    graphdef, state = nnx.split(moe_model)

    @jax.jit
    def trainer_forward(state, *arrays):  # noqa: ANN001, ANN202
        model = nnx.merge(graphdef, state)
        *inputs, forced = arrays
        logp, _, routing = completion_logprobs(
            model, *inputs, jnp.float32(1.0), loop=models.UNROLLED, mesh=None, routes=forced
        )
        return logp, routing

    logp, routing = trainer_forward(state, tokens, positions, prompt, targets, routes)
    used = np.asarray(routing.experts).transpose(1, 2, 0, 3)  # [B, L, layers, k]
    recorded = routes >= 0
    np.testing.assert_array_equal(used[recorded], routes[recorded])
    for i, ro in enumerate(rollouts):
        np.testing.assert_allclose(np.asarray(logp)[i, : len(ro.tokens)], ro.logprobs, atol=1e-5)
