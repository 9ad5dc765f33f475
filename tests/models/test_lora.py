"""LoRA adapters in the model family (issue [lora], the model's part): the adapted forward equals
the base model with W + (α/r)·A·B merged in float32, gradients equal those of that merged form,
the base's init is untouched, the engine serves adapters unmerged, checkpoints load and export them.

Tolerances: f32 forward of a 2-layer tiny model, merged vs unmerged: the sums differ in order
only, 1e-5 absolute on logits of size ~1; gradients 1e-5 relative to their largest entry.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import ConfigError, ModelConfig
from rlax_tpu.config.model import LORA_TARGETS
from rlax_tpu.models.layers import LoRAParam

BASE = dataclasses.replace(models.preset("tiny"), num_layers=2)
LORA = dataclasses.replace(BASE, lora_rank=4, lora_alpha=8.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, BASE.vocab_size, (2, 12)), jnp.int32)
# projection -> (its module's attribute path in a layer, adapter attribute)
WHERE = {
    "q_proj": ("attn", "q_lora"),
    "k_proj": ("attn", "k_lora"),
    "v_proj": ("attn", "v_lora"),
    "o_proj": ("attn", "o_lora"),
    "gate_proj": ("mlp", "gate_lora"),
    "up_proj": ("mlp", "up_lora"),
    "down_proj": ("mlp", "down_lora"),
}


def _randomize_b(model: models.Transformer, seed: int = 1) -> None:
    """B is zero at init (the adapted model starts as the base): give it values to test with."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        for module, name in WHERE.values():
            adapter = getattr(getattr(layer, module), name)
            if adapter is not None:
                b = adapter.b[...]
                adapter.b[...] = jnp.asarray(0.05 * rng.standard_normal(b.shape), jnp.float32)


def _merged(model: models.Transformer, cfg: ModelConfig) -> models.Transformer:
    """The base model (no adapters) with W + scale·A·B, computed in float64 on the host."""
    base = models.init_model(dataclasses.replace(cfg, lora_rank=0))
    for src, dst in zip(model.layers, base.layers, strict=True):
        for proj, (module, name) in WHERE.items():
            adapter = getattr(getattr(src, module), name)
            if adapter is None:
                continue
            a, b = np.asarray(adapter.a[...], np.float64), np.asarray(adapter.b[...], np.float64)
            delta = adapter.scale * np.tensordot(a, b, axes=1)
            w = getattr(getattr(src, module), proj)
            getattr(getattr(dst, module), proj)[...] = jnp.asarray(
                np.asarray(w[...], np.float64) + delta, jnp.float32
            )
    return base


def test_adapters_start_at_zero_and_leave_the_base_init_alone():
    adapted, plain = models.init_model(LORA), models.init_model(BASE)
    base_of = nnx.to_pure_dict(nnx.state(adapted, nnx.Not(LoRAParam)))
    assert jax.tree.all(
        jax.tree.map(np.array_equal, base_of, nnx.to_pure_dict(nnx.state(plain)))
    ), "adapters changed the base weights' random init"
    adapters = jax.tree.leaves(nnx.state(adapted, LoRAParam))
    assert len(adapters) == 2 * len(LORA_TARGETS) * LORA.num_layers
    assert all(x.dtype == jnp.float32 for x in adapters)
    np.testing.assert_array_equal(models.forward(adapted, TOKENS), models.forward(plain, TOKENS))
    a = adapted.layers[0].mlp.down_lora.a[...]  # [F, r]: N(0, 1/F)
    assert a.shape == (BASE.intermediate_size, 4)
    assert abs(float(jnp.std(a)) * np.sqrt(BASE.intermediate_size) - 1) < 0.15


def test_the_adapted_forward_is_the_merged_weights_forward():
    model = models.init_model(LORA)
    _randomize_b(model)
    got = models.forward(model, TOKENS)
    want = models.forward(_merged(model, LORA), TOKENS)
    assert float(jnp.max(jnp.abs(got - models.forward(models.init_model(BASE), TOKENS)))) > 0.01
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "down_proj")], ids=["all", "two"])
def test_adapter_gradients_are_those_of_the_merged_form(targets):
    """d loss / d(A, B) by autodiff through the adapted model against autodiff through the
    merged weights W + scale·A·B as an explicit function of A and B."""
    cfg = dataclasses.replace(LORA, lora_targets=targets)
    model = models.init_model(cfg)
    _randomize_b(model)
    graphdef, adapters, base = nnx.split(model, LoRAParam, ...)
    target = jax.nn.one_hot(TOKENS[:, 1:], cfg.vocab_size)

    def loss_adapted(adapters):
        logits = models.forward(nnx.merge(graphdef, adapters, base), TOKENS)[:, :-1]
        return -jnp.mean(jnp.sum(target * jax.nn.log_softmax(logits), -1))

    plain = models.init_model(dataclasses.replace(cfg, lora_rank=0))
    pgraph, pstate = nnx.split(plain)

    def loss_merged(adapters):
        merged = nnx.merge(graphdef, adapters, base)
        state = jax.tree.map(lambda x: x, pstate)
        weights = nnx.to_pure_dict(pstate)
        for i, layer in enumerate(merged.layers):
            for proj in targets:
                module, name = WHERE[proj]
                ad = getattr(getattr(layer, module), name)
                w = getattr(getattr(layer, module), proj)[...]
                delta = ad.scale * jnp.tensordot(ad.a[...], ad.b[...], axes=1)
                weights["layers"][i][module][proj] = w + delta
        nnx.replace_by_pure_dict(state, weights)
        logits = models.forward(nnx.merge(pgraph, state), TOKENS)[:, :-1]
        return -jnp.mean(jnp.sum(target * jax.nn.log_softmax(logits), -1))

    got = nnx.to_pure_dict(jax.grad(loss_adapted)(adapters))
    want = nnx.to_pure_dict(jax.grad(loss_merged)(adapters))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 0
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)


def test_lora_config_is_checked():
    with pytest.raises(ConfigError, match="lora_targets"):
        dataclasses.replace(BASE, lora_rank=4, lora_targets=("qkv",))
    with pytest.raises(ConfigError, match="lora_rank"):
        dataclasses.replace(BASE, lora_rank=-1)


def test_the_engine_serves_adapters_unmerged_with_the_forward_s_log_probs():
    """The inference engine runs the adapted model as it is (base + A·B in the projections'
    path, the base never rewritten): its sampled log-probs equal the full-sequence forward's
    to f32 round-off (the engine's own tolerance against another program, 1e-5)."""
    from rlax_tpu.config import InferenceConfig
    from rlax_tpu.inference.engine import Engine
    from rlax_tpu.inference.sampler import SamplingParams
    from rlax_tpu.inference.scheduler import Request

    model = models.init_model(LORA)
    _randomize_b(model)
    cfg = InferenceConfig(
        max_concurrent_seqs=4, page_size=4, kv_cache_bytes=2**20, max_prompt_len=12,
        max_new_tokens=8,
    )  # fmt: skip
    engine = Engine(model, cfg)
    engine.submit(
        Request(
            prompt_id="p",
            prompt_tokens=tuple(int(t) for t in TOKENS[0]),
            num_samples=2,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=3),
        )
    )
    for ro in engine.run():
        seq = jnp.asarray([[*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]], jnp.int32)
        logp = jax.nn.log_softmax(models.forward(model, seq)[0, len(ro.prompt_tokens) - 1 : -1])
        want = np.take_along_axis(np.asarray(logp), ro.tokens[:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(ro.logprobs, want, rtol=0, atol=1e-5)
        merged = models.forward(_merged(model, LORA), seq)[0, len(ro.prompt_tokens) - 1 : -1]
        assert float(jnp.max(jnp.abs(jax.nn.log_softmax(merged) - logp))) < 1e-4


def test_a_base_checkpoint_loads_with_fresh_adapters_and_exports_them_merged(tmp_path):
    """Adapters are not in an HF checkpoint: loading one with lora_rank > 0 gives the
    checkpoint's base and the adapters init_model gives; exporting a trained adapted model
    writes W + scale·A·B (the merged model's logits), not the base alone."""
    from rlax_tpu.models.checkpoint import load_safetensors, save_safetensors

    base = models.init_model(dataclasses.replace(BASE, seed=7))
    save_safetensors(base, tmp_path / "base")
    _, loaded = load_safetensors(tmp_path / "base", cfg=LORA)
    np.testing.assert_array_equal(models.forward(loaded, TOKENS), models.forward(base, TOKENS))
    # As a run loads it: the file's architecture has no adapters, the run's config adds them.
    run_cfg = dataclasses.replace(
        LORA, weights_format="safetensors", weights_path=str(tmp_path / "base")
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.to_pure_dict(nnx.state(models.load_model(run_cfg))),
        nnx.to_pure_dict(nnx.state(loaded)),
    )
    fresh = nnx.to_pure_dict(nnx.state(models.init_model(LORA), LoRAParam))
    got = nnx.to_pure_dict(nnx.state(loaded, LoRAParam))
    # The same draws; init_model makes them inside its jit, so to f32 round-off (1 ulp seen).
    jax.tree.map(lambda g, f: np.testing.assert_allclose(g, f, rtol=1e-6, atol=0), got, fresh)
    bs = [x for path, x in jax.tree_util.tree_leaves_with_path(got) if path[-1].key == "b"]
    assert len(bs) == len(LORA_TARGETS) * LORA.num_layers and not any(np.any(b) for b in bs)

    _randomize_b(loaded)
    save_safetensors(loaded, tmp_path / "merged")
    _, exported = load_safetensors(tmp_path / "merged", cfg=BASE)
    np.testing.assert_allclose(
        models.forward(exported, TOKENS), models.forward(loaded, TOKENS), rtol=0, atol=1e-5
    )


def test_a_small_delta_merged_into_bf16_is_warned_and_kept_exactly_in_float32(caplog):
    """[pod-fidelity]: exporting merged W + scale·A·B to bf16 rounded away deltas under half a
    bf16 spacing of W (an RL run's often are): the export now says so, with the fraction lost,
    and ``dtype="float32"`` keeps the float32 merge exactly."""
    import logging

    from rlax_tpu.models.checkpoint import hf_tensors

    cfg = dataclasses.replace(LORA, param_dtype="bfloat16")
    model = models.init_model(cfg)
    for layer in model.layers:  # a delta of about 1e-6: far under bf16's spacing at 0.02
        for module, name in WHERE.values():
            adapter = getattr(getattr(layer, module), name)
            if adapter is not None:
                adapter.b[...] = jnp.full(adapter.b[...].shape, 1e-5, adapter.b[...].dtype)
    with caplog.at_level(logging.WARNING, logger="rlax_tpu.models.checkpoint"):
        rounded = hf_tensors(model)
    warned = [r.getMessage() for r in caplog.records if "LoRA delta" in r.getMessage()]
    assert warned and "bfloat16" in warned[0], caplog.text
    lost = float(warned[0].split("on ")[1].split("%")[0])
    assert lost > 90
    caplog.clear()
    exact = hf_tensors(model, dtype="float32")
    assert not [r for r in caplog.records if "LoRA delta" in r.getMessage()]
    # q_proj of layer 0, against the float32 merge computed here.
    layer = model.layers[0].attn
    base = np.asarray(layer.q_proj[...], np.float32)
    a = np.asarray(layer.q_lora.a[...], np.float32)
    b = np.asarray(layer.q_lora.b[...], np.float32)
    merged = base + cfg.lora_alpha / cfg.lora_rank * np.tensordot(a, b, axes=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert exact[name].dtype == np.float32 and rounded[name].dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(exact[name], merged.reshape(merged.shape[0], -1).T)
    assert not np.array_equal(np.asarray(rounded[name], np.float32), exact[name])
    # A float32 model exported to bf16 loses it alike, and is warned alike.
    model32 = models.init_model(LORA)
    for layer in model32.layers:
        for module, attr in WHERE.values():
            adapter = getattr(getattr(layer, module), attr)
            if adapter is not None:
                adapter.b[...] = jnp.full(adapter.b[...].shape, 1e-5, adapter.b[...].dtype)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlax_tpu.models.checkpoint"):
        hf_tensors(model32, dtype="bfloat16")
    assert [r for r in caplog.records if "LoRA delta" in r.getMessage()], caplog.text
