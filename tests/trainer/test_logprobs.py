"""The vocab-parallel (shard_map) log-prob equals the plain one; the remat'd training forward
equals the plain forward.

Tolerance: vocab-parallel splits the log-sum-exp over 2-4 devices (a different summation order),
so log-probs agree to 2e-6 absolute (values ~ -6) and gradients to 1e-6 absolute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import MeshConfig
from rlax_tpu.trainer.logprobs import (
    completion_logprobs,
    hidden_states,
    plain_logprobs,
    vocab_parallel_logprobs,
)
from rlax_tpu.trainer.mesh import build_mesh


def _inputs(seed: int, b: int = 8, t: int = 12):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.integers(0, 512, (b, t)), jnp.int32)


@pytest.mark.parametrize(("mesh_shape", "tied"), [((2, 1, 4), True), ((1, 4, 2), False)])
def test_vocab_parallel_equals_plain(mesh_shape, tied):
    cfg = models.preset("tiny", num_layers=1, tie_embeddings=tied)
    mesh = build_mesh(MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]))
    model = models.init_model(cfg, mesh=mesh, seed=3)
    graphdef, params = nnx.split(model)
    tokens = _inputs(0)
    targets = jnp.roll(tokens, -1, axis=1)
    temperature = jnp.float32(0.7)

    def both(params):
        m = nnx.merge(graphdef, params)
        hidden, _ = hidden_states(m, tokens, models.default_positions(tokens))
        return (
            plain_logprobs(m, hidden, targets, temperature),
            vocab_parallel_logprobs(m, hidden, targets, temperature, mesh),
        )

    with jax.set_mesh(mesh):
        plain, parallel = jax.jit(both)(params)
        np.testing.assert_allclose(np.asarray(parallel), np.asarray(plain), rtol=0, atol=2e-6)
        # Independent reference: log-softmax of the full logits in numpy (f64).
        logits = np.asarray(models.forward(model, tokens), np.float64) / 0.7
        ref = (
            np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
            - logits.max(-1)
        )
        np.testing.assert_allclose(np.asarray(parallel), ref, rtol=0, atol=2e-5)
        # Gradients through the collectives match too.
        g_plain = jax.jit(jax.grad(lambda p: both(p)[0].sum()))(params)
        g_parallel = jax.jit(jax.grad(lambda p: both(p)[1].sum()))(params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6),
        g_parallel,
        g_plain,
    )


def test_remat_forward_and_grad_equal_plain():
    cfg = models.preset("tiny", num_layers=2)
    model = models.init_model(cfg, seed=1)
    graphdef, params = nnx.split(model)
    tokens = _inputs(1, b=4, t=10)
    prompt = jnp.array([3, 4, 5, 2], jnp.int32)
    targets = jnp.take_along_axis(tokens, jnp.clip(prompt[:, None] + jnp.arange(5), 0, 9), 1)
    positions = models.default_positions(tokens)

    def f(params, remat):
        logp, _, _ = completion_logprobs(
            nnx.merge(graphdef, params),
            tokens,
            positions,
            prompt,
            targets,
            jnp.float32(1.0),
            loop=models.LayerLoop(remat="nothing_saveable" if remat else None),
            mesh=None,
        )
        return logp

    plain = jax.jit(lambda p: f(p, False))(params)
    remat = jax.jit(lambda p: f(p, True))(params)
    np.testing.assert_allclose(np.asarray(remat), np.asarray(plain), rtol=0, atol=1e-6)
    # The remat'd value really is the completion's: compare with the plain forward's log-probs.
    full = models.token_logprobs(models.forward(model, tokens)[:, :-1], tokens[:, 1:])
    cols = np.clip(np.asarray(prompt)[:, None] - 1 + np.arange(5), 0, 8)
    np.testing.assert_allclose(
        np.asarray(plain), np.take_along_axis(np.asarray(full), cols, 1), rtol=0, atol=1e-6
    )
    g_plain = jax.jit(jax.grad(lambda p: f(p, False).sum()))(params)
    g_remat = jax.jit(jax.grad(lambda p: f(p, True).sum()))(params)
    # Recomputation may fuse differently from the saved forward: gradients agree to 1e-5.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5),
        g_remat,
        g_plain,
    )

    # nothing_saveable: the remat'd gradient program recomputes the layers (more dots in it).
    def dots(fn):
        return jax.jit(fn).lower(params).as_text().count("dot_general")

    assert dots(jax.grad(lambda p: f(p, True).sum())) > dots(jax.grad(lambda p: f(p, False).sum()))
