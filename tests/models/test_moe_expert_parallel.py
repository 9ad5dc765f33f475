"""Expert parallelism on 8 CPU devices: a MoE model with its experts split over the mesh's expert
axis gives the single-device forward's logits, routing and gradients (f32, to round-off: the
expert groups' partial sums add in another order)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlax_tpu import models
from rlax_tpu.config import MeshConfig
from rlax_tpu.models.sharding import make_mesh, shard_model

CFG = models.preset(
    "tiny",
    arch="qwen3_moe",
    qk_norm=True,
    num_layers=1,  # the layer loop is not what is tested
    num_experts=8,
    experts_per_token=2,
    expert_intermediate_size=64,
)
TOL = 2e-5  # f32: the same products, summed over the expert group in another order


def _loss_and_grads(
    model: models.Transformer,
    tokens: jax.Array,
    forced: jax.Array | None,
    positions: jax.Array | None = None,
):
    """(logits [B, T, V], router logits, experts, gradient of a log-likelihood of every
    parameter) through one jitted program (under the current mesh, if any)."""
    graphdef, state = nnx.split(model)
    if positions is None:
        positions = models.default_positions(tokens)

    def loss(state):  # noqa: ANN001, ANN202
        m = nnx.merge(graphdef, state)
        hidden, _, routing = m.run(tokens, positions, models.NoCache(), routes=forced)
        logits = m.logits(hidden)
        logp = models.token_logprobs(logits[:, :-1], tokens[:, 1:])
        return -logp.mean(), (logits, routing)

    (_, (logits, routing)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, routing, grads


def _compare(
    mesh_cfg: MeshConfig,
    batch: int,
    length: int,
    *,
    forced: bool = False,
    kernel: str = "auto",
    padded: bool = False,
) -> None:
    """The sharded model (its experts' matmuls by ``kernel``) against one device's (ragged_dot).
    ``padded``: each row ends in padding (position -1), row r of length - r tokens (at least 1):
    padding goes to no expert (experts -1) on both."""
    tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, CFG.vocab_size, jnp.int32)
    positions = None
    if padded:
        lengths = np.maximum(length - np.arange(batch), 1)[:, None]
        columns = np.arange(length)[None, :]
        positions = jnp.asarray(np.where(columns < lengths, columns, -1), jnp.int32)
    routes = None
    if forced:  # another expert than the router's first choice, in every layer
        _, routing, _ = _loss_and_grads(models.init_model(CFG, seed=3), tokens, None)
        routes = (routing.experts + 3) % CFG.num_experts
    want = _loss_and_grads(models.init_model(CFG, seed=3), tokens, routes, positions)
    mesh = make_mesh(mesh_cfg)
    cfg = dataclasses.replace(CFG, expert_kernel=kernel)
    model = shard_model(models.init_model(cfg, seed=3), mesh)
    with jax.set_mesh(mesh):
        got = _loss_and_grads(model, tokens, routes, positions)
    if padded:
        pad = np.asarray(positions) < 0
        assert pad.any() and (~pad).any()
        experts = np.asarray(got[1].experts)  # [layers, B, T, k]
        assert (experts[:, pad] == -1).all() and (experts[:, ~pad] >= 0).all()
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(got[1].experts), np.asarray(want[1].experts))
    np.testing.assert_allclose(
        np.asarray(got[1].logits), np.asarray(want[1].logits), atol=TOL, rtol=0
    )
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(want[2]), strict=True
    ):
        scale = float(np.abs(np.asarray(w)).max()) or 1.0
        err = float(np.abs(np.asarray(g) - np.asarray(w)).max())
        assert err <= 1e-4 * scale, f"{jax.tree_util.keystr(path)}: {err} vs max {scale}"


@pytest.mark.parametrize(
    "mesh_cfg",
    [
        MeshConfig(data=1, fsdp=2, expert=4, tensor=1),  # tokens spread over the expert group
        MeshConfig(data=2, fsdp=1, expert=2, tensor=2),  # and each expert's width split
    ],
    ids=["fsdp2-expert4", "data2-expert2-tensor2"],
)
def test_expert_parallel_forward_and_gradient_equal_one_devices(mesh_cfg):
    """With rows of padding, as batches come ([pod-fidelity]: padding goes to no expert)."""
    _compare(mesh_cfg, batch=8, length=12, padded=True)


def test_rows_the_batch_axes_do_not_split_and_forced_routes():
    # 3 rows do not split 8 ways: every device holds them all and only sums its experts' part.
    _compare(MeshConfig(data=1, fsdp=1, expert=8, tensor=1), batch=3, length=5, forced=True)


def test_megablox_kernels_in_the_expert_parallel_layer():
    # The TPU kernels (interpreted) on each device's local experts, rows past them zeroed:
    # rows spread over the expert group, and rows every device holds whole.
    _compare(MeshConfig(data=1, fsdp=2, expert=4, tensor=1), 4, 6, kernel="megablox_interpret")
    _compare(
        MeshConfig(data=1, fsdp=1, expert=8, tensor=1),
        3,
        5,
        forced=True,
        kernel="megablox_interpret",
    )


def test_each_device_holds_its_experts_only():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=4, tensor=1))
    model = shard_model(models.init_model(CFG), mesh)
    gate = model.layers[0].mlp.gate_proj[...]
    assert gate.sharding.spec == P("expert", "fsdp", None)
    assert gate.addressable_shards[0].data.shape == (8 // 4, 128 // 2, 64)
    # The router and the dense weights: their model dimension over fsdp and expert together.
    q = model.layers[0].attn.q_proj[...]
    assert q.sharding.spec == P(("fsdp", "expert"), None, None)


def test_experts_must_divide_over_the_axis():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=8, tensor=1))
    cfg = dataclasses.replace(CFG, num_experts=4)
    model = models.init_model(cfg)
    tokens = jnp.zeros((8, 4), jnp.int32)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="does not divide the model's 4"):
        models.forward(model, tokens)


def test_megablox_on_a_mesh_without_an_expert_axis_runs_in_the_layers_shard_map():
    # XLA cannot partition a Pallas kernel: on a data x tensor mesh (an engine's) the layer
    # takes its shard_map with an expert axis of 1, rows over data and the width over tensor.
    _compare(MeshConfig(data=4, fsdp=1, expert=1, tensor=2), 4, 6, kernel="megablox_interpret")


def _collectives(jaxpr: jax.core.Jaxpr) -> list[tuple[str, jnp.dtype, tuple[int, ...]]]:
    """(primitive, operand dtype, operand shape) of every collective in ``jaxpr``, nested."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("psum", "psum2", "reduce_scatter", "psum_scatter", "all_gather"):
            out += [(name, v.aval.dtype, tuple(v.aval.shape)) for v in eqn.invars]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _collectives(inner)
    return out


def test_router_and_expert_gradients_are_summed_in_float32_under_bf16_compute():
    """bf16 compute, float32 masters, experts over expert and their model dimension over fsdp,
    rows over data too: the gradients of the router ([E, X]) and of the experts (rank 3) are
    reduced across devices in float32 (the sum over data and the reduce-scatter over fsdp),
    while the experts' forward all-gather over fsdp moves bf16. (On 726f913 the weights were
    cast before the shard_map, so all of these sums were bf16.)"""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", param_dtype="float32")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2, tensor=1))
    graphdef, state = nnx.split(shard_model(models.init_model(cfg), mesh))
    tokens = jnp.zeros((8, 12), jnp.int32)

    def loss(state):  # noqa: ANN001, ANN202
        m = nnx.merge(graphdef, state)
        hidden, _, _ = m.run(tokens, models.default_positions(tokens), models.NoCache())
        return m.logits(hidden).astype(jnp.float32).mean()

    with jax.set_mesh(mesh):
        found = _collectives(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
    router = (cfg.hidden_size, cfg.num_experts)
    sums = [c for c in found if c[0] != "all_gather" and (len(c[2]) == 3 or c[2] == router)]
    kinds = {(name, len(shape)) for name, _, shape in sums}
    assert {("psum", 2), ("psum", 3), ("reduce_scatter", 3)} <= kinds, found
    assert all(dtype == jnp.float32 for _, dtype, _ in sums), sums
    gathers = [c for c in found if c[0] == "all_gather" and len(c[2]) == 3]
    assert len(gathers) == 3 and all(dtype == jnp.bfloat16 for _, dtype, _ in gathers), gathers
