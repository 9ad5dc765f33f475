"""Training attention through JAX's TPU splash kernel (interpret mode on CPU) against the dense
reference: the loss and its gradients with respect to every parameter, on right-padded rows of
ragged lengths (as the trainer's batches are), on one device and in shard_map under a mesh.

Tolerance: both run in f32; the kernel sums its blocks with an online softmax in another order
(observed ~1e-6 on log-probs and gradients of O(0.1); the sharded run also splits sums over
devices): log-probs 2e-5 absolute, gradients 1e-4 relative + 5e-6 absolute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import MeshConfig
from rlax_tpu.trainer.logprobs import completion_logprobs

CFG = models.preset("tiny", num_layers=2)


def _batch(rows: int = 4, length: int = 40, width: int = 12, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    totals = rng.integers(width + 2, length + 1, rows)
    totals[0] = length  # one full row
    cols = np.arange(length)[None, :]
    positions = np.where(cols < totals[:, None], cols, -1).astype(np.int32)
    tokens = np.where(positions >= 0, rng.integers(0, CFG.vocab_size, (rows, length)), 0)
    prompts = (totals - width).astype(np.int32)
    targets = np.take_along_axis(
        tokens, np.clip(prompts[:, None] + np.arange(width), 0, length - 1), axis=1
    )
    return {
        k: jnp.asarray(v, jnp.int32)
        for k, v in dict(
            tokens=tokens, positions=positions, prompt_lengths=prompts, targets=targets
        ).items()
    }


def _loss_and_grads(state, graphdef, batch, attention: str, mesh=None):  # noqa: ANN001, ANN202
    def loss(state):  # noqa: ANN001, ANN202
        model = nnx.merge(graphdef, state)
        logp, _, _ = completion_logprobs(
            model,
            batch["tokens"],
            batch["positions"],
            batch["prompt_lengths"],
            batch["targets"],
            jnp.float32(1.0),
            loop=models.LayerLoop(remat="nothing_saveable"),
            mesh=mesh,
            attention=attention,
        )
        return logp.sum(), logp

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)


@pytest.fixture(scope="module")
def reference():
    graphdef, state = nnx.split(models.init_model(CFG, seed=3))
    batch = _batch()
    (_, logp), grads = _loss_and_grads(state, graphdef, batch, "dense")
    return graphdef, state, batch, logp, grads


def _check(got, reference) -> None:  # noqa: ANN001
    (_, logp), grads = got
    np.testing.assert_allclose(logp, reference[3], rtol=0, atol=2e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(reference[4]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-6)


def test_splash_loss_and_gradients_equal_dense(reference):
    graphdef, state, batch, _, _ = reference
    _check(_loss_and_grads(state, graphdef, batch, "splash_interpret"), reference)


def test_splash_in_shard_map_under_a_mesh_equals_dense(reference):
    graphdef, state, batch, _, _ = reference
    mesh = models.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
    with jax.set_mesh(mesh):
        sharded = jax.device_put(state, models.param_shardings(state, mesh))
        got = _loss_and_grads(sharded, graphdef, batch, "splash_interpret", mesh=mesh)
    _check(got, reference)
