"""Mixture-of-experts layers: logits against HF transformers' Qwen3-MoE and Mixtral (tiny random
configs), the grouped matmuls against a dense all-experts reference (values and gradients), and
forced routing."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rlax_tpu import models
from rlax_tpu.config import ConfigError
from rlax_tpu.models.attention import NoCache
from rlax_tpu.models.checkpoint import abstract_model, load_safetensors, save_safetensors
from rlax_tpu.models.moe import grouped_swiglu, load_balancing_loss, route
from rlax_tpu.models.transformer import LayerLoop, forward

from .conftest import hf_logits, random_hf_model

TOL = 1e-4  # max abs logit difference in f32, as for the dense families
TOKENS = np.random.default_rng(0).integers(0, 96, size=(2, 24))
MOE_HF = {
    # Qwen3-MoE: QK-norm, experts narrower than the dense width, 8 experts, top 2 (both the
    # renormalized and the raw-softmax weighting).
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen3_moe_raw_weights": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
        },
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.mark.parametrize("case", list(MOE_HF))
def test_logits_match_hf_and_survive_a_safetensors_round_trip(case, tmp_path):
    arch, overrides = MOE_HF[case]
    hf = random_hf_model(arch, **overrides)
    reference = hf_logits(hf, TOKENS)
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = load_safetensors(tmp_path / "hf")
    assert cfg.arch == arch and cfg.num_experts == (
        overrides.get("num_experts") or overrides.get("num_local_experts")
    )
    ours = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)))
    assert np.abs(ours - reference).max() <= TOL
    save_safetensors(model, tmp_path / "ours")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert np.abs(hf_logits(reloaded, TOKENS) - reference).max() <= TOL


def _dense_reference(x, router, gate, up, down, k, normalize):
    """Every expert on every token, then the top-k mixture: the textbook MoE."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    top = jnp.argsort(-probs, axis=-1)[:, :k]
    w = jnp.take_along_axis(probs, top, axis=-1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    outs = jnp.stack(
        [(jax.nn.silu(x @ gate[j]) * (x @ up[j])) @ down[j] for j in range(gate.shape[0])], axis=1
    )  # [N, X, E]
    picked = jnp.take_along_axis(outs, top[:, :, None], axis=1)  # [N, k, E]
    return jnp.einsum("nke,nk->ne", picked, w)


def _sparse(x, router, gate, up, down, k, normalize, kernel="ragged_dot"):
    w, experts = route(x @ router, k, normalize=normalize)
    return jnp.einsum("nke,nk->ne", grouped_swiglu(x, experts, gate, up, down, kernel), w)


@pytest.mark.parametrize(
    "normalize, kernel",
    [(True, "ragged_dot"), (False, "ragged_dot"), (True, "megablox_interpret")],
)
def test_grouped_matmuls_equal_every_expert_on_every_token_values_and_gradients(normalize, kernel):
    rng = np.random.default_rng(1)
    n, e, f, x_, k = 13, 8, 6, 5, 2
    args = [
        jnp.asarray(rng.normal(size=s), jnp.float32)
        for s in ((n, e), (e, x_), (x_, e, f), (x_, e, f), (x_, f, e))
    ]
    sparse = partial(_sparse, kernel=kernel)
    np.testing.assert_allclose(
        sparse(*args, k, normalize), _dense_reference(*args, k, normalize), rtol=1e-5, atol=1e-6
    )
    # Gradients for every input (the router's through the weights of the chosen experts).
    for i in range(5):
        g_sparse, g_dense = (
            jax.grad(lambda a, f=f, i=i: f(*args[:i], a, *args[i + 1 :], k, normalize).sum())(
                args[i]
            )
            for f in (sparse, _dense_reference)
        )
        np.testing.assert_allclose(g_sparse, g_dense, rtol=1e-4, atol=1e-5)


def test_forced_routes_use_the_given_experts_weighted_by_the_routers_probabilities():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(7, 6)), jnp.float32)
    w, chosen = route(logits, 2, normalize=True)
    w2, again = route(logits, 2, normalize=True, forced=chosen)
    np.testing.assert_array_equal(again, chosen)
    np.testing.assert_array_equal(w2, w)  # the router's own choice, forced: the same bits
    other = (chosen + 1) % 6
    w3, used = route(logits, 2, normalize=False, forced=other)
    np.testing.assert_array_equal(used, other)
    probs = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(w3, jnp.take_along_axis(probs, other, axis=-1), rtol=1e-6)


def test_a_token_with_an_unrecorded_route_takes_the_routers_own_choice():
    # -1 marks a position the engine did not record (padding, a prompt it never saw): that
    # token's row is the router's top k, the others stay forced.
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32)
    w, chosen = route(logits, 2, normalize=True)
    forced = np.array((chosen + 1) % 6)
    forced[1] = [-1, -1]
    forced[3, 0] = -1  # one entry missing: the whole row is the router's
    w2, used = route(logits, 2, normalize=True, forced=jnp.asarray(forced))
    for row in range(5):
        want = chosen[row] if row in (1, 3) else forced[row]
        np.testing.assert_array_equal(used[row], want)
    np.testing.assert_array_equal(w2[1], w[1])
    np.testing.assert_array_equal(w2[3], w[3])


def test_a_moe_model_forces_its_routes_through_the_layer():
    cfg = dataclasses.replace(
        models.preset("tiny"), arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2
    )
    layer = models.init_model(cfg).layers[0].mlp
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, cfg.hidden_size)), jnp.float32)
    y, logits, experts = layer(x)
    assert logits.shape == (2, 5, 4) and experts.shape == (2, 5, 2)
    y2, _, experts2 = layer(x, forced=experts)
    np.testing.assert_array_equal(experts2, experts)
    np.testing.assert_array_equal(y2, y)
    y3, _, experts3 = layer(x, forced=(experts + 1) % 4)
    assert not np.allclose(y3, y)


def test_moe_configs_are_checked():
    base = models.preset("tiny")
    with pytest.raises(ConfigError, match="num_experts.*must be > 0 for arch 'mixtral'"):
        dataclasses.replace(base, arch="mixtral")
    with pytest.raises(ConfigError, match=r"experts_per_token.*\[1, num_experts = 4\]"):
        dataclasses.replace(base, num_experts=4, experts_per_token=5)
    with pytest.raises(ConfigError, match="LoRA on mixture-of-experts models is not built yet"):
        dataclasses.replace(base, num_experts=4, lora_rank=2)


def test_the_configs_parameter_count_equals_a_moe_models_tree():
    for arch in ("qwen3_moe", "mixtral"):
        cfg = dataclasses.replace(
            models.preset("tiny"),
            arch=arch,
            qk_norm=arch == "qwen3_moe",
            num_experts=4,
            expert_intermediate_size=24 if arch == "qwen3_moe" else 0,
        )
        tree = nnx.to_pure_dict(nnx.state(abstract_model(cfg)))  # shapes only
        assert sum(x.size for x in jax.tree.leaves(tree)) == cfg.param_count(), arch


def test_the_load_balancing_loss_equals_hfs_and_its_gradient_the_closed_form():
    """Values against transformers' load_balancing_loss_func (the same Switch Transformer
    formula over all layers' rows); the gradient against d/dz_j = (X/R)·w·p_j·(f_j − Σ f·p),
    the softmax Jacobian applied to X·Σ f·P by hand."""
    rng = np.random.default_rng(4)
    layers, b, t, x, k = 3, 2, 5, 6, 2
    logits = jnp.asarray(rng.normal(size=(layers, b, t, x)), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, size=(b, t)), jnp.float32).at[0, 0].set(1.0)
    ours = load_balancing_loss(logits, k, mask)
    hf = load_balancing_loss_func(
        tuple(torch.tensor(np.array(logits[i]).reshape(b * t, x)) for i in range(layers)),
        x,
        k,
        torch.tensor(np.array(mask)),
    )
    np.testing.assert_allclose(float(ours), float(hf), rtol=1e-6)

    grad = np.asarray(jax.grad(lambda z: load_balancing_loss(z, k, mask))(logits))
    p = np.asarray(jax.nn.softmax(logits, axis=-1))
    top = np.argsort(-p, axis=-1)[..., :k]
    w = np.broadcast_to(np.asarray(mask), (layers, b, t))
    rows = w.sum()
    f = np.zeros(x)
    for idx in np.ndindex(layers, b, t):
        f[top[idx]] += w[idx] / rows
    want = (x / rows) * w[..., None] * p * (f - (p * f).sum(-1, keepdims=True))
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_a_moe_models_routing_comes_out_and_forced_routes_go_in():
    cfg = models.preset("tiny", arch="mixtral", num_experts=4, experts_per_token=2, num_layers=3)
    model = models.init_model(cfg)
    tokens = jnp.asarray(TOKENS % cfg.vocab_size, jnp.int32)
    positions = models.default_positions(tokens)
    hidden, _, routing = model.run(tokens, positions, NoCache())
    assert routing.logits.shape == (3, 2, 24, 4) and routing.experts.shape == (3, 2, 24, 2)
    # The scanned, rematerialized loop routes the same and replays the given routes.
    scanned = LayerLoop(scan=True, remat="nothing_saveable")
    h2, _, r2 = model.run(tokens, positions, NoCache(), scanned, routes=routing.experts)
    np.testing.assert_array_equal(r2.experts, routing.experts)
    np.testing.assert_allclose(h2, hidden, rtol=1e-5, atol=1e-5)
    other = (routing.experts + 1) % 4
    _, _, r3 = model.run(tokens, positions, NoCache(), routes=other)
    np.testing.assert_array_equal(r3.experts, other)
    with pytest.raises(ValueError, match="without experts"):
        models.init_model(models.preset("tiny")).run(tokens, positions, NoCache(), routes=other)


def test_gate_logits_are_float32_products_of_the_compute_dtype_inputs():
    """[pod-fidelity]: in a bf16-compute model the router's logits came out of a bf16 matmul,
    rounded to 8 bits before the top k (near-ties picked by rounding). Now they are the float32
    products of the bf16 inputs and router (MaxText's float32 gate logits): equal to a float64
    reference of those inputs to float32 accumulation error, finer than a bf16 spacing."""
    cfg = models.preset(
        "tiny",
        arch="qwen3_moe",
        qk_norm=True,
        num_layers=1,
        num_experts=8,
        experts_per_token=2,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
    )
    moe = models.init_model(cfg, seed=2).layers[0].mlp
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, cfg.hidden_size)), jnp.bfloat16)
    _, logits, _ = moe(x)
    assert logits.dtype == jnp.float32
    router = np.asarray(moe.router[...].astype(jnp.bfloat16), np.float64)
    want = np.asarray(x, np.float64).reshape(10, -1) @ router
    got = np.asarray(logits, np.float64).reshape(10, -1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # A bf16 product would be off by up to half a spacing (2^-9 relative) on most entries.
    rounded = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
    assert np.abs(got - want).max() < 0.1 * np.abs(rounded - want).max()


def test_padding_goes_to_no_expert_and_costs_no_expert_work(monkeypatch):
    """[pod-fidelity]: positions of -1 (padding, as batches and the engine's idle rows are laid
    out) get no route (experts -1, weight 0) and never reach the grouped matmuls: their rows are
    outside every group (before: the router's top k, computed k times). The other tokens' outputs
    and routes are those of the same tokens without the padding (the MoE mixes no tokens)."""
    import rlax_tpu.models.moe as moe

    cfg = models.preset("tiny", arch="mixtral", num_experts=4, experts_per_token=2, num_layers=1)
    layer = models.init_model(cfg, seed=2).layers[0].mlp
    x = jax.random.normal(jax.random.key(0), (2, 6, cfg.hidden_size), jnp.float32)
    valid = jnp.asarray([[True] * 6, [True] * 2 + [False] * 4])
    rows = []
    real = moe.grouped_matmul
    monkeypatch.setattr(
        moe,
        "grouped_matmul",
        lambda *a, sizes, **kw: rows.append(int(sizes.sum())) or real(*a, sizes=sizes, **kw),
    )
    y, logits, experts = layer(x, valid=valid)
    assert rows == [8 * 2] * 3  # gate, up, down: the 8 real tokens' 2 experts each
    np.testing.assert_array_equal(np.asarray(experts)[1, 2:], -1)
    assert (np.asarray(experts)[valid] >= 0).all()
    np.testing.assert_array_equal(np.asarray(y)[1, 2:], 0.0)
    rows.clear()
    y_all, _, experts_all = layer(x)
    assert rows == [12 * 2] * 3
    np.testing.assert_allclose(np.asarray(y)[valid], np.asarray(y_all)[valid], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(experts)[valid], np.asarray(experts_all)[valid])
