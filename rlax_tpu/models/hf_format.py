"""The Hugging Face checkpoint format: config.json <-> ModelConfig, and tensor names/layouts.

HF stores linear weights as [out, in]; the model stores kernels as [in, ...out] with heads split
out (see ``Transformer``). Each :class:`TensorMapping` knows both layouts and converts between
them, so loaders and the exporter share one table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rlax_tpu.config import ConfigError, ModelConfig
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.layers import has_o_bias

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# Where a MoE layer's router and experts sit in each family's checkpoints: (module prefix,
# router, expert gate / up / down projection names).
_MOE_NAMES = {
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
}
_ROPE_TYPES = {
    "default": "none",
    "linear": "linear",
    "dynamic": "dynamic",
    "llama3": "llama3",
    "yarn": "yarn",
}

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """One parameter and its HF tensor; with ``experts`` > 0 the parameter stacks that many HF
    tensors on a leading axis, ``hf_name`` a template with ``{j}`` for the expert and
    ``hf_shape``, ``to_model``, ``to_hf`` of one of them."""

    hf_name: str
    path: Path  # path of the nnx.Param in the model's state
    hf_shape: tuple[int, ...]
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    experts: int = 0

    @property
    def hf_names(self) -> list[str]:
        if not self.experts:
            return [self.hf_name]
        return [self.hf_name.format(j=j) for j in range(self.experts)]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def tensor_mappings(cfg: ModelConfig) -> list[TensorMapping]:
    """Every parameter of a model built from ``cfg``, with its HF name and layout."""
    e, v = cfg.hidden_size, cfg.vocab_size
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim

    def qkv(heads: int) -> tuple[Callable, Callable]:
        return (
            lambda w: np.ascontiguousarray(w.T.reshape(e, heads, d)),
            lambda w: np.ascontiguousarray(w.reshape(e, heads * d).T),
        )

    out: list[TensorMapping] = [
        TensorMapping("model.embed_tokens.weight", ("embed",), (v, e), _same, _same),
        TensorMapping("model.norm.weight", ("final_norm", "weight"), (e,), _same, _same),
    ]
    if not cfg.tie_embeddings:
        out.append(TensorMapping("lm_head.weight", ("lm_head",), (v, e), _transpose, _transpose))
    for i in range(cfg.num_layers):
        p, layer = f"model.layers.{i}.", ("layers", i)
        attn = layer + ("attn",)
        out += [
            TensorMapping(
                p + "input_layernorm.weight", layer + ("input_norm", "weight"), (e,), _same, _same
            ),
            TensorMapping(
                p + "post_attention_layernorm.weight",
                layer + ("post_attn_norm", "weight"),
                (e,),
                _same,
                _same,
            ),
            TensorMapping(p + "self_attn.q_proj.weight", attn + ("q_proj",), (h * d, e), *qkv(h)),
            TensorMapping(
                p + "self_attn.k_proj.weight", attn + ("k_proj",), (hkv * d, e), *qkv(hkv)
            ),
            TensorMapping(
                p + "self_attn.v_proj.weight", attn + ("v_proj",), (hkv * d, e), *qkv(hkv)
            ),
            TensorMapping(
                p + "self_attn.o_proj.weight",
                attn + ("o_proj",),
                (e, h * d),
                lambda w: np.ascontiguousarray(w.T.reshape(h, d, e)),
                lambda w: np.ascontiguousarray(w.reshape(h * d, e).T),
            ),
        ]
        out += _moe_mappings(cfg, p, layer) if cfg.num_experts else _mlp_mappings(cfg, p, layer)
        if cfg.qkv_bias:
            for name, heads in (("q", h), ("k", hkv), ("v", hkv)):
                out.append(
                    TensorMapping(
                        f"{p}self_attn.{name}_proj.bias",
                        attn + (f"{name}_bias",),
                        (heads * d,),
                        lambda b, heads=heads: b.reshape(heads, d),
                        lambda b: b.reshape(-1),
                    )
                )
        if has_o_bias(cfg):
            out.append(
                TensorMapping(p + "self_attn.o_proj.bias", attn + ("o_bias",), (e,), _same, _same)
            )
        if cfg.qk_norm:
            for name in ("q", "k"):
                out.append(
                    TensorMapping(
                        f"{p}self_attn.{name}_norm.weight",
                        attn + (f"{name}_norm", "weight"),
                        (d,),
                        _same,
                        _same,
                    )
                )
    return out


def _mlp_mappings(cfg: ModelConfig, p: str, layer: Path) -> list[TensorMapping]:
    e, f = cfg.hidden_size, cfg.intermediate_size
    return [
        TensorMapping(
            p + "mlp.gate_proj.weight", layer + ("mlp", "gate_proj"), (f, e), _transpose, _transpose
        ),
        TensorMapping(
            p + "mlp.up_proj.weight", layer + ("mlp", "up_proj"), (f, e), _transpose, _transpose
        ),
        TensorMapping(
            p + "mlp.down_proj.weight", layer + ("mlp", "down_proj"), (e, f), _transpose, _transpose
        ),
    ]


def _moe_mappings(cfg: ModelConfig, p: str, layer: Path) -> list[TensorMapping]:
    e, f, x = cfg.hidden_size, cfg.resolved_expert_intermediate_size, cfg.num_experts
    module, router, (gate, up, down) = _MOE_NAMES[cfg.arch]
    q = f"{p}{module}."
    mlp = layer + ("mlp",)
    return [
        TensorMapping(f"{q}{router}.weight", mlp + ("router",), (x, e), _transpose, _transpose),
        TensorMapping(
            q + "experts.{j}." + gate + ".weight",
            mlp + ("gate_proj",),
            (f, e),
            _transpose,
            _transpose,
            x,
        ),
        TensorMapping(
            q + "experts.{j}." + up + ".weight",
            mlp + ("up_proj",),
            (f, e),
            _transpose,
            _transpose,
            x,
        ),
        TensorMapping(
            q + "experts.{j}." + down + ".weight",
            mlp + ("down_proj",),
            (e, f),
            _transpose,
            _transpose,
            x,
        ),
    ]


def _moe_from_hf(hf: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe / mixtral config.json (refusing what the model lacks)."""
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ModelLoadError(
            source,
            "dense layers among the MoE layers (decoder_sparse_step, mlp_only_layers) "
            "are not supported: every layer must be MoE",
        )
    if hf.get("sliding_window") and model_type == "mixtral":
        raise ModelLoadError(
            source, "field 'sliding_window' is set: sliding-window attention is not supported"
        )
    if hf.get("router_jitter_noise"):
        raise ModelLoadError(source, "field 'router_jitter_noise' > 0 is not supported")
    if hf.get("shared_expert_intermediate_size"):
        raise ModelLoadError(source, "shared experts are not supported")
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts:
        raise ModelLoadError(
            source, "required field 'num_experts' (or 'num_local_experts') is missing"
        )
    return dict(
        num_experts=experts,
        experts_per_token=hf.get("num_experts_per_tok", 2),
        expert_intermediate_size=hf.get("moe_intermediate_size") or 0,
        # Mixtral renormalizes the chosen experts' weights always; Qwen3-MoE when configured.
        norm_topk_prob=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
    )


def config_from_hf(hf: Mapping[str, Any], source: str, **overrides: Any) -> ModelConfig:
    """ModelConfig from a parsed HF ``config.json`` (``source`` names the file for errors).

    ``overrides`` set ModelConfig fields HF does not describe (dtypes, weights_path ...).
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(
            source,
            f"field 'model_type' = {model_type!r} is not a supported architecture; "
            f"supported: {', '.join(ARCHITECTURES)}",
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            source, f"field 'hidden_act' = {hf['hidden_act']!r}: only 'silu' is supported"
        )
    if hf.get("mlp_bias"):
        raise ModelLoadError(source, "field 'mlp_bias' = true is not supported")
    if hf.get("use_sliding_window"):
        raise ModelLoadError(source, "field 'use_sliding_window' = true is not supported")
    try:
        heads = hf["num_attention_heads"]
        kw: dict[str, Any] = dict(
            arch=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or 0,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        if model_type in _MOE_NAMES:
            kw.update(_moe_from_hf(hf, model_type, source))
    except KeyError as e:
        raise ModelLoadError(source, f"required field {e.args[0]!r} is missing") from None
    kw.update(_rope_from_hf(hf, source))
    kw.update(overrides)
    try:
        return ModelConfig(**kw)
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(source, f"does not describe a valid model: {e}") from None


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older files rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(
            source, f"rope type {kind!r} is not supported; supported: {', '.join(_ROPE_TYPES)}"
        )
    out: dict[str, Any] = {
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        "rope_scaling": _ROPE_TYPES[kind],
    }
    if kind != "default":
        out["rope_scaling_factor"] = float(rope.get("factor", 1.0))
    for hf_key, key in (
        ("original_max_position_embeddings", "rope_original_max_position_embeddings"),
        ("low_freq_factor", "rope_low_freq_factor"),
        ("high_freq_factor", "rope_high_freq_factor"),
        ("beta_fast", "rope_beta_fast"),
        ("beta_slow", "rope_beta_slow"),
        ("attention_factor", "rope_attention_factor"),
    ):
        if rope.get(hf_key) is not None:
            cast = int if hf_key == "original_max_position_embeddings" else float
            out[key] = cast(rope[hf_key])
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers-loadable ``config.json`` dict for ``cfg``."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling != "none":
        rope.update(rope_type=cfg.rope_scaling, factor=cfg.rope_scaling_factor)
    if cfg.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = (
            cfg.resolved_rope_original_max_position_embeddings
        )
    if cfg.rope_scaling == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor
        )
    if cfg.rope_scaling == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_attention_factor:
            rope["attention_factor"] = cfg.rope_attention_factor
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "dtype": cfg.param_dtype,
    }
    if cfg.arch == "mixtral" and cfg.qkv_bias:
        raise ModelLoadError(
            "config.json", "mixtral has no attention biases; qkv_bias=True cannot be exported"
        )
    if cfg.arch not in ("qwen2", "mixtral"):
        out["attention_bias"] = cfg.qkv_bias  # q, k, v and o_proj biases (see has_o_bias)
    if cfg.num_experts:
        out.update(
            num_experts_per_tok=cfg.experts_per_token,
            num_local_experts=cfg.num_experts,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
        )
    if cfg.arch == "qwen3_moe":
        out.update(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.resolved_expert_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if cfg.arch == "mixtral":
        if not cfg.norm_topk_prob or cfg.resolved_expert_intermediate_size != cfg.intermediate_size:
            raise ModelLoadError(
                "config.json",
                "mixtral renormalizes the top-k weights and its experts are intermediate_size "
                "wide: norm_topk_prob=False or expert_intermediate_size cannot be exported",
            )
        out["sliding_window"] = None
    if cfg.arch == "qwen2" and not cfg.qkv_bias:
        raise ModelLoadError(
            "config.json", "qwen2 always has QKV bias; qkv_bias=False cannot be exported"
        )
    return out
