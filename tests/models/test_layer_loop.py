"""Scan over layers (models.LayerLoop): the same loss and gradients as the unrolled model, with
and without remat, on one device and under a mesh; one compiled layer body whatever the depth.

Tolerance: the scanned program runs the same per-layer math, but XLA fuses a loop body and an
unrolled chain differently, so f32 results agree to round-off: log-probs (values ~ -6) to 2e-6
absolute, each gradient leaf to 1e-5 of its largest entry.
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
from rlax_tpu.trainer.mesh import build_mesh


def _batch(b: int = 4, t: int = 12, width: int = 5):
    r = np.random.default_rng(0)
    tokens = jnp.asarray(r.integers(0, 512, (b, t)), jnp.int32)
    prompt = jnp.asarray(r.integers(2, t - width, (b,)), jnp.int32)
    targets = jnp.take_along_axis(tokens, prompt[:, None] + jnp.arange(width), axis=1)
    return tokens, models.default_positions(tokens), prompt, targets


def _loss_and_grads(graphdef, params, loop: models.LayerLoop, mesh=None):  # noqa: ANN001, ANN202
    tokens, positions, prompt, targets = _batch()

    def f(params):  # noqa: ANN001, ANN202
        logp, _, _ = completion_logprobs(
            nnx.merge(graphdef, params),
            tokens,
            positions,
            prompt,
            targets,
            jnp.float32(0.9),
            loop=loop,
            mesh=mesh,
        )
        return logp.sum(), logp

    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


def _assert_same(got, want) -> None:  # noqa: ANN001
    (_, logp), grads = got
    (_, logp_ref), grads_ref = want
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_ref), rtol=0, atol=2e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(np.abs(b).max())
        ),
        grads,
        grads_ref,
    )


@pytest.mark.parametrize("remat", [None, "nothing_saveable", "dots_saveable"])
def test_scan_equals_unrolled(remat):
    cfg = models.preset("tiny", num_layers=3, qk_norm=True, qkv_bias=True, tie_embeddings=False)
    graphdef, params = nnx.split(models.init_model(cfg, seed=4))
    unrolled = _loss_and_grads(graphdef, params, models.LayerLoop())
    _assert_same(
        _loss_and_grads(graphdef, params, models.LayerLoop(scan=True, remat=remat)), unrolled
    )
    # Every layer got its own gradient (the stacked gradient was split back per layer).
    (_, _), grads = unrolled
    norms = [
        float(jnp.linalg.norm(layer["mlp"]["up_proj"][...])) for layer in grads["layers"].values()
    ]
    assert len(set(norms)) == 3 and min(norms) > 0


def test_scan_under_a_mesh():
    cfg = models.preset("tiny", num_layers=2)
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, params = nnx.split(models.init_model(cfg, seed=5, mesh=mesh))
    with jax.set_mesh(mesh):
        unrolled = _loss_and_grads(graphdef, params, models.LayerLoop(), mesh)
        scanned = _loss_and_grads(
            graphdef, params, models.LayerLoop(scan=True, remat="nothing_saveable"), mesh
        )
    _assert_same(scanned, unrolled)


def _dots(num_layers: int, scan: bool) -> int:
    cfg = models.preset("tiny", num_layers=num_layers)
    graphdef, params = nnx.split(models.init_model(cfg, seed=0))
    tokens, positions, prompt, targets = _batch()

    def f(params):  # noqa: ANN001, ANN202
        logp, _, _ = completion_logprobs(
            nnx.merge(graphdef, params),
            tokens,
            positions,
            prompt,
            targets,
            jnp.float32(1.0),
            loop=models.LayerLoop(scan=scan, remat="nothing_saveable"),
            mesh=None,
        )
        return logp.sum()

    return jax.jit(jax.grad(f)).lower(params).as_text().count("dot_general")


def test_scanned_program_does_not_grow_with_depth():
    assert _dots(2, scan=True) == _dots(6, scan=True)
    assert _dots(6, scan=False) > _dots(2, scan=False)


def test_scan_refuses_a_cache_that_stores():
    cfg = models.preset("tiny", num_layers=2)
    model = models.init_model(cfg, seed=0)
    tokens = jnp.zeros((1, 4), jnp.int32)
    cache = models.make_dense_cache(cfg, 1, 8)
    with pytest.raises(ValueError, match="stateless cache"):
        model(tokens, models.default_positions(tokens), cache, models.LayerLoop(scan=True))
    with pytest.raises(ValueError, match="unknown remat policy"):
        models.LayerLoop(remat="bogus")
