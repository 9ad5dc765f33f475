"""The two entry points agree: full forward == cached steps (prefill, chunked prefill, decode),
padding (negative positions) changes nothing for real tokens, dtypes behave as configured."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu.models.attention import DenseKVCache
from rlax_tpu.models.presets import preset
from rlax_tpu.models.transformer import (
    default_positions,
    init_model,
    make_dense_cache,
    token_logprobs,
)
from rlax_tpu.models.transformer import forward as _forward
from rlax_tpu.models.transformer import step as _step

# Jitted: compiling is cheaper than running eagerly op by op on CPU.
forward, step = nnx.jit(_forward), nnx.jit(_step)

# Qwen3-style features on the tiny shape so every code path runs.
CFG = preset("tiny", arch="qwen3", qk_norm=True, qkv_bias=True, tie_embeddings=False, head_dim=48)
TOL = 1e-5  # same math, different shapes / summation order, f32


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=1)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(0), (3, 12), 0, CFG.vocab_size, jnp.int32)


def test_forward_equals_prefill_chunks_then_decode(model, tokens):
    full = forward(model, tokens)
    positions = default_positions(tokens)
    cache = make_dense_cache(CFG, batch=3, max_len=16)
    pieces = []
    for lo, hi in ((0, 5), (5, 8), (8, 9), (9, 10), (10, 11), (11, 12)):  # prefill chunks, decode
        logits, cache = step(model, tokens[:, lo:hi], positions[:, lo:hi], cache)
        pieces.append(logits)
    assert isinstance(cache, DenseKVCache)
    assert np.abs(np.concatenate(pieces, axis=1) - np.asarray(full)).max() <= TOL


def test_ragged_chunks_with_padding_slots(model, tokens):
    """Rows at different lengths share one [B, T] step; padding slots (position -1) are neither
    stored nor attended to."""
    full = np.asarray(forward(model, tokens))
    cache = make_dense_cache(CFG, batch=3, max_len=16)
    lengths = [12, 7, 3]  # prompts of different lengths, prefilled in one padded chunk
    pos = np.full((3, 12), -1, np.int32)
    for b, n in enumerate(lengths):
        pos[b, :n] = np.arange(n)
    logits, cache = step(model, tokens, jnp.asarray(pos), cache)
    for b, n in enumerate(lengths):
        assert np.abs(np.asarray(logits)[b, :n] - full[b, :n]).max() <= TOL
    # Next step: rows 1 and 2 continue with their next real token, row 0 idles (padding).
    nxt = np.asarray(tokens)[np.arange(3), [0, 7, 3]][:, None]
    logits, _ = step(model, jnp.asarray(nxt), jnp.asarray([[-1], [7], [3]], jnp.int32), cache)
    assert np.abs(np.asarray(logits)[1, 0] - full[1, 7]).max() <= TOL
    assert np.abs(np.asarray(logits)[2, 0] - full[2, 3]).max() <= TOL


def test_left_padded_forward_matches_unpadded(model, tokens):
    short = tokens[1:2, :8]
    padded = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), short], axis=1)
    positions = jnp.asarray([[-1] * 4 + list(range(8))], jnp.int32)
    out = np.asarray(forward(model, padded, positions))[:, 4:]
    assert np.abs(out - np.asarray(forward(model, short))).max() <= TOL


def test_step_jits_with_a_donated_cache(model, tokens):
    graphdef, state = nnx.split(model)

    def run(state, toks, pos, cache):
        return step(nnx.merge(graphdef, state), toks, pos, cache)

    jitted = jax.jit(run, donate_argnums=3)
    cache = make_dense_cache(CFG, batch=3, max_len=16)
    logits, new_cache = jitted(state, tokens, default_positions(tokens), cache)
    assert cache.k.is_deleted()  # donated: updated in place
    assert isinstance(new_cache, DenseKVCache)
    assert np.abs(np.asarray(logits) - np.asarray(forward(model, tokens))).max() <= TOL


def test_token_logprobs_is_log_softmax_gather():
    logits = jax.random.normal(jax.random.key(3), (2, 5, 11))
    targets = jax.random.randint(jax.random.key(4), (2, 5), 0, 11)
    expected = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits)), np.asarray(targets)[..., None], -1
    )[..., 0]
    np.testing.assert_allclose(np.asarray(token_logprobs(logits, targets)), expected, atol=1e-6)


def test_bf16_params_and_compute_keep_f32_logits(model, tokens):
    bf16 = init_model(preset("tiny", param_dtype="bfloat16", compute_dtype="bfloat16"), seed=1)
    f32 = init_model(preset("tiny"), seed=1)
    assert bf16.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    out = forward(bf16, tokens)
    assert out.dtype == jnp.float32
    # Same seed, same weights up to bf16 rounding.
    assert np.abs(np.asarray(out) - np.asarray(forward(f32, tokens))).max() < 0.05
    cache = make_dense_cache(bf16.cfg, batch=3, max_len=16)
    assert cache.k.dtype == jnp.bfloat16
    logits, _ = step(bf16, tokens, default_positions(tokens), cache)
    assert logits.dtype == jnp.float32


def test_tiny_preset_matches_the_local_run_config():
    import importlib.util
    from pathlib import Path

    from rlax_tpu.config import RunConfig, from_dict

    path = Path(__file__).resolve().parents[2] / "configs" / "codeforces.py"
    spec = importlib.util.spec_from_file_location("codeforces_cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    local = from_dict(RunConfig, mod.get_config("local")).model
    assert local == preset("tiny")
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(init_model(local))))
    assert 5e5 < n_params < 5e6


def test_one_init_program_serves_every_seed_and_draws_what_nnx_rngs_of_the_seed_draws():
    """The seed is the init program's argument, not a constant in it (a program per seed cost
    the suite a compile per seed): a second seed compiles nothing, not even from the
    persistent cache, and the weights are the ones nnx.Rngs(seed) draws (up to float32
    round-off between two compiled programs: the old form's constant seed let XLA fold them)."""
    from jax import monitoring

    from rlax_tpu.models.transformer import Transformer

    cfg = preset("tiny", num_layers=1, vocab_size=384)
    compiles = []

    def on_compile(event: str, duration_secs: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration_secs)

    states = {1234: nnx.to_pure_dict(nnx.state(init_model(cfg, seed=1234)))}
    monitoring.register_event_duration_secs_listener(on_compile)
    try:
        states[1235] = nnx.to_pure_dict(nnx.state(init_model(cfg, seed=1235)))
    finally:
        monitoring.unregister_event_duration_listener(on_compile)
    assert compiles == [], compiles
    for seed, state in states.items():
        direct = jax.jit(lambda s=seed: nnx.state(Transformer(cfg, rngs=nnx.Rngs(s))))()
        want = jax.tree.leaves(nnx.to_pure_dict(direct))
        for a, b in zip(jax.tree.leaves(state), want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    first, second = (jax.tree.leaves(states[s]) for s in states)
    assert any(not np.array_equal(a, b) for a, b in zip(first, second, strict=True))
