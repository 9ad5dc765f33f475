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
    hf_name: str
    path: Path  # path of the nnx.Param in the model's state
    hf_shape: tuple[int, ...]
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def tensor_mappings(cfg: ModelConfig) -> list[TensorMapping]:
    """Every parameter of a model built from ``cfg``, with its HF name and layout."""
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
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
            TensorMapping(
                p + "mlp.gate_proj.weight",
                layer + ("mlp", "gate_proj"),
                (f, e),
                _transpose,
                _transpose,
            ),
            TensorMapping(
                p + "mlp.up_proj.weight", layer + ("mlp", "up_proj"), (f, e), _transpose, _transpose
            ),
            TensorMapping(
                p + "mlp.down_proj.weight",
                layer + ("mlp", "down_proj"),
                (e, f),
                _transpose,
                _transpose,
            ),
        ]
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
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
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
    if cfg.arch != "qwen2":
        out["attention_bias"] = cfg.qkv_bias  # q, k, v and o_proj biases (see has_o_bias)
    if cfg.arch == "qwen2" and not cfg.qkv_bias:
        raise ModelLoadError(
            "config.json", "qwen2 always has QKV bias; qkv_bias=False cannot be exported"
        )
    return out
