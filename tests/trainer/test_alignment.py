"""The aligned π_old recompute against an independent sampler, and against itself.

The sampler here is an engine-like decode loop written independently of ``models.scoring``: it
runs ``models.step`` with a ``DenseKVCache``, one token per row per step with sequences at
*different* positions and admitted at different times (continuous batching), samples from the
temperature-scaled f32 logits and reports log-softmax(logits / T) of the sampled token, as the
engine documents. It is another program than the engine's, so the replay matches it to f32
round-off (the bitwise match with the real engine is ``test_alignment_engine.py``); the replay
of the same rows in another order is bitwise itself (same programs) wherever this host rounds
every row alike (``models.scoring.rows_bitwise``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.models.scoring import ReplayShape, replay_logprobs, rows_bitwise
from rlax_tpu.trainer import Trainer
from rlax_tpu.types import TrainBatch

from .helpers import GROUP, run_config

SLOTS, CACHE = 8, 48  # the sampler's rows per step and KV positions per sequence
SHAPE = ReplayShape(slots=SLOTS, page_size=16, pages_per_seq=CACHE // 16, num_pages=1 + SLOTS * 3)
ROUND_OFF = 1e-5  # another program's f32 rounding (observed < 1e-6)
TEMPERATURE = 0.8


@jax.jit
def _sample_step(state, tokens, positions, cache, key, temperature):
    logits, cache = models.step(nnx.merge(_GRAPHDEF[0], state), tokens, positions, cache)
    scaled = logits[:, 0] / temperature  # [B, V] f32
    sampled = jax.random.categorical(key, scaled)
    logp = jax.nn.log_softmax(scaled)[jnp.arange(len(sampled)), sampled]
    return sampled, logp, cache


_GRAPHDEF: list = []


def engine_like_sample(model, prompts, max_new, seed):
    """Samples completions for ``prompts`` (list of int arrays); a row slot is given to the next
    prompt when free, one token per row per step. Returns (completions, logprobs)."""
    graphdef, state = nnx.split(model)
    _GRAPHDEF[:] = [graphdef]
    cache = models.make_dense_cache(model.cfg, SLOTS, CACHE)
    key = jax.random.PRNGKey(seed)
    queue = list(range(len(prompts)))
    slot_seq = [-1] * SLOTS  # which prompt each slot serves
    pos = [0] * SLOTS
    out_tok = [[] for _ in prompts]
    out_lp = [[] for _ in prompts]
    step = 0
    while queue or any(s >= 0 for s in slot_seq):
        # Admit one prompt per step (staggered starts).
        if queue and -1 in slot_seq:
            slot = slot_seq.index(-1)
            slot_seq[slot], pos[slot] = queue.pop(0), 0
        fed = np.zeros(SLOTS, np.int32)
        positions = np.full(SLOTS, -1, np.int32)
        for s, i in enumerate(slot_seq):
            if i < 0:
                continue
            seq = np.concatenate([prompts[i], out_tok[i]]).astype(np.int32)
            fed[s], positions[s] = seq[pos[s]], pos[s]
        key, sub = jax.random.split(key)
        sampled, logp, cache = _sample_step(
            state,
            jnp.asarray(fed[:, None]),
            jnp.asarray(positions[:, None]),
            cache,
            sub,
            jnp.float32(TEMPERATURE),
        )
        sampled, logp = np.asarray(sampled), np.asarray(logp)
        for s, i in enumerate(slot_seq):
            if i < 0:
                continue
            if pos[s] >= len(prompts[i]) - 1:  # the logits of the last fed token sample the next
                out_tok[i].append(int(sampled[s]))
                out_lp[i].append(float(logp[s]))
            pos[s] += 1
            if len(out_tok[i]) == max_new[i]:
                slot_seq[s] = -1
        step += 1
    return out_tok, out_lp


@pytest.fixture(scope="module")
def sampled():
    cfg = models.preset("tiny", num_layers=2)
    model = models.init_model(cfg, seed=5)
    r = np.random.default_rng(0)
    n = 12
    prompts = [r.integers(0, 512, r.integers(2, 10)) for _ in range(n)]
    max_new = [int(x) for x in r.integers(1, 20, n)]
    completions, logprobs = engine_like_sample(model, prompts, max_new, seed=1)
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    tokens = np.zeros((n, length), np.int32)
    lp = np.zeros((n, 20), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p)], tokens[i, len(p) : len(p) + len(c)] = p, c
        lp[i, : len(c)] = logprobs[i]
    batch = TrainBatch(
        tokens=tokens,
        prompt_lengths=np.array([len(p) for p in prompts], np.int32),
        completion_lengths=np.array(max_new, np.int32),
        behaviour_logprobs=lp,
        rewards=r.integers(0, 2, n).astype(np.float32),
        versions=np.zeros(n, np.int64),
        group_size=GROUP,
        temperature=TEMPERATURE,
    )
    return model, batch


def test_replay_matches_an_independent_sampler_and_itself_in_any_order(sampled):
    model, batch = sampled
    replay = replay_logprobs(
        model,
        batch.tokens,
        batch.prompt_lengths,
        batch.completion_lengths,
        shape=SHAPE,
        temperature=TEMPERATURE,
        width=20,
    )
    mask = batch.completion_mask() > 0
    assert mask.sum() > 100
    np.testing.assert_allclose(replay[mask], batch.behaviour_logprobs[mask], rtol=0, atol=ROUND_OFF)
    assert (replay[~mask] == 0).all()
    # Rows in reverse order (other rows beside each one): the same bits.
    rev = replay_logprobs(
        model,
        batch.tokens[::-1],
        batch.prompt_lengths[::-1],
        batch.completion_lengths[::-1],
        shape=SHAPE,
        temperature=TEMPERATURE,
        width=20,
    )
    if rows_bitwise(model, SHAPE):
        np.testing.assert_array_equal(rev[::-1], replay)
    else:  # this host rounds rows by their index (models/programs.py)
        np.testing.assert_allclose(rev[::-1], replay, rtol=0, atol=ROUND_OFF)


def _trainer_on(model, batch, tmp_path, align, **trainer):
    cfg = run_config(align_logprobs=align, micro_batch_size=4, model=model.cfg, **trainer)
    cfg = dataclasses.replace(
        # prefill_rows 0: the fixture sampled every token as a [SLOTS, 1] row.
        cfg,
        inference=dataclasses.replace(
            cfg.inference, max_concurrent_seqs=SLOTS, page_size=16, prefill_rows=0
        ),
        controller=dataclasses.replace(cfg.controller, prompts_per_step=len(batch.tokens) // GROUP),
    )
    return Trainer(cfg, model=model, devices=jax.devices()[:1], checkpoint_dir=tmp_path)


def test_trainer_metric_pins_alignment(sampled, tmp_path):
    model, batch = sampled
    aligned = _trainer_on(model, batch, tmp_path / "a", align=True)
    shape = aligned.replay_shape
    assert (shape.slots, shape.cache_len, shape.prefill_rows) == (SLOTS, CACHE, 0)
    m_on = aligned.train_step(batch)
    aligned.close()
    # Aligned against this independent sampler: the mismatch is f32 round-off (against the real
    # engine it is exactly 0: test_alignment_engine.py).
    assert m_on["logp_old_behaviour_diff_max"] <= ROUND_OFF
    assert m_on["aligned_logprobs"] == 1.0
    plain = _trainer_on(model, batch, tmp_path / "b", align=False)
    m_off = plain.train_step(batch)
    plain.close()
    # Alignment off: one full-sequence forward; the mismatch is reported (round-off: how much,
    # even whether any, depends on the host).
    assert m_off["aligned_logprobs"] == 0.0
    assert 0.0 <= m_off["logp_old_behaviour_diff_max"] < ROUND_OFF
    assert 0.0 <= m_off["logp_old_behaviour_diff_mean"] <= m_off["logp_old_behaviour_diff_p95"]
    print(
        f"alignment off: |log pi_old - log mu| mean {m_off['logp_old_behaviour_diff_mean']:.3g}"
        f" p95 {m_off['logp_old_behaviour_diff_p95']:.3g} max {m_off['logp_old_behaviour_diff_max']:.3g}"
    )


def test_prefill_recompute_scanned(sampled, tmp_path):
    """trainer.old_logprobs = "prefill" (RLAX §5.1: one prefill-shaped pass per micro-batch
    through the engine's paged attention) with scanned layers: π_old agrees with the independent
    sampler to round-off and the update's loss with the token-by-token replay's."""
    model, batch = sampled
    replay = _trainer_on(model, batch, tmp_path / "r", align=True)
    m_replay = replay.train_step(batch)
    replay.close()
    prefill = _trainer_on(
        model, batch, tmp_path / "p", align=True, old_logprobs="prefill", scan_layers=True
    )
    assert prefill.old_logprobs == "prefill"
    m = prefill.train_step(batch)
    prefill.close()
    assert m["logp_old_prefill"] == 1.0 and m_replay["logp_old_prefill"] == 0.0
    assert m["logp_old_behaviour_diff_max"] <= ROUND_OFF
    np.testing.assert_allclose(m["loss"], m_replay["loss"], rtol=1e-4, atol=1e-6)
