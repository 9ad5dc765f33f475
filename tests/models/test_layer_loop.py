"""Scan over layers (models.LayerLoop): the same loss and gradients as the unrolled model, with
and without remat, on one device and under a mesh; one compiled layer body whatever the depth.

Tolerance: the scanned program runs the same per-layer math, but XLA fuses a loop body and an
unrolled chain differently, so f32 results agree to round-off: log-probs (values ~ -6) to 2e-6
absolute, each gradient leaf to 1e-5 of its largest entry.
"""

from __future__ import annotations

import jax
import jax.extend
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


def _logp_sum(graphdef, loop: models.LayerLoop, mesh=None):  # noqa: ANN001, ANN202
    """params -> (the batch's summed completion log-probs, the log-probs [B, T])."""
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

    return f


def _loss_and_grads(graphdef, params, loop: models.LayerLoop, mesh=None):  # noqa: ANN001, ANN202
    return jax.jit(jax.value_and_grad(_logp_sum(graphdef, loop, mesh), has_aux=True))(params)


def _assert_same(got, want, *, logp_atol: float = 2e-6, grad_rel: float = 1e-5) -> None:  # noqa: ANN001
    """Log-probs within ``logp_atol``, each gradient leaf within ``grad_rel`` of its largest
    entry (compared in float32)."""
    (_, logp), grads = got
    (_, logp_ref), grads_ref = want
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_ref), rtol=0, atol=logp_atol)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)

    def close(a, b) -> None:  # noqa: ANN001
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=grad_rel * float(np.abs(b).max()))

    jax.tree.map(close, grads, grads_ref)


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
    loop = models.LayerLoop(scan=scan, remat="nothing_saveable")
    grad = jax.grad(_logp_sum(graphdef, loop), has_aux=True)
    return jax.jit(grad).lower(params).as_text().count("dot_general")


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


def _avals(jaxpr: jax.extend.core.Jaxpr):  # noqa: ANN202
    """Every value a jaxpr and the jaxprs inside it (scan bodies, remat, pjit) make."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_scanned_layers_stack_the_compute_dtype_not_the_float32_masters(moe):
    """[pod-fidelity]: float32 masters with bf16 compute, layers scanned. The stack and its
    cotangent are in bf16 for every weight the layer casts where it uses it (before: JAX emitted
    a float32 copy of every layer's weights and a float32 cotangent, which only fed the bf16 cast;
    XLA for TPU already moved the cast before the stack, benchmarks/RESULTS.md, but nothing held
    it to); the MoE's stay as stored, since they enter its shard_map
    uncast so their gradients are summed in float32 (tests/models/test_moe_expert_parallel.py).
    The scanned loss and gradients are the unrolled model's (same casts, same values; bf16
    matmuls fused differently: log-probs within 0.02, gradient leaves within 2% of their largest
    entry)."""
    extra = dict(arch="mixtral", num_experts=4, experts_per_token=2) if moe else {}
    cfg = models.preset(
        "tiny", num_layers=3, param_dtype="float32", compute_dtype="bfloat16", **extra
    )
    graphdef, params = nnx.split(models.init_model(cfg, seed=6))
    loop = models.LayerLoop(scan=True, remat="nothing_saveable")
    grad = jax.grad(_logp_sum(graphdef, loop), has_aux=True)
    made = {(a.shape, a.dtype) for a in _avals(jax.make_jaxpr(grad)(params).jaxpr)}
    layer0 = nnx.to_flat_state(params["layers"][0])
    checked = 0
    for path, variable in layer0:
        if variable[...].ndim < 2:
            continue
        stacked = (3, *variable[...].shape)
        as_stored = path[0] == "mlp" and moe
        assert ((stacked, jnp.dtype("float32")) in made) == as_stored, path
        assert ((stacked, jnp.dtype("bfloat16")) in made) != as_stored, path
        checked += 1
    assert checked >= (8 if moe else 7)
    _assert_same(
        _loss_and_grads(graphdef, params, loop),
        _loss_and_grads(graphdef, params, models.LayerLoop()),
        logp_atol=2e-2,
        grad_rel=2e-2,
    )
