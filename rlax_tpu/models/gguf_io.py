"""GGUF (llama.cpp) checkpoints: config, dequantized weights, and the embedded tokenizer data.

Tensors are renamed to HF names and handed to ``checkpoint.build_model``. llama.cpp's converter
permutes Llama's Q/K rows from HF's half-rotation RoPE layout to its interleaved one; that is
undone here (Qwen2/Qwen3 files are not permuted).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from rlax_tpu.config import ConfigError, ModelConfig
from rlax_tpu.models.checkpoint import build_model
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.gguf_file import GGUFFile
from rlax_tpu.models.transformer import Transformer

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
_GGUF_ROPE = {"none": "none", "linear": "linear", "yarn": "yarn"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name for a GGUF tensor name (None if the model does not use it)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, interleaved (x0 y0 x1 y1 ...) rows back to
    halves (x0 x1 ... y0 y1 ...). ``w`` is [heads * D, ...] (HF layout)."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(f: GGUFFile, **overrides: Any) -> ModelConfig:
    """ModelConfig from the file's metadata (``overrides`` set dtypes etc.)."""
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f.path,
            f"field 'general.architecture' = {arch!r} is not a supported architecture; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}",
        )
    if "rope_freqs.weight" in f.tensors:
        raise ModelLoadError(
            f.path, "tensor 'rope_freqs.weight' (per-frequency RoPE factors) is not supported"
        )
    hidden, heads = (
        int(f.require(f"{arch}.embedding_length")),
        int(f.require(f"{arch}.attention.head_count")),
    )
    tokens = f.field("tokenizer.ggml.tokens")
    rope_kind = f.field(f"{arch}.rope.scaling.type", "none")
    if rope_kind not in _GGUF_ROPE:
        raise ModelLoadError(
            f.path, f"field '{arch}.rope.scaling.type' = {rope_kind!r} is not supported"
        )
    kw: dict[str, Any] = dict(
        arch=arch,
        vocab_size=int(f.field(f"{arch}.vocab_size", len(tokens or ()))),
        hidden_size=hidden,
        intermediate_size=int(f.require(f"{arch}.feed_forward_length")),
        num_layers=int(f.require(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(f.field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.field(f"{arch}.attention.key_length", 0)),
        rope_theta=float(f.field(f"{arch}.rope.freq_base", 10_000.0)),
        rope_scaling=_GGUF_ROPE[rope_kind],
        max_position_embeddings=int(f.field(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        tie_embeddings="output.weight" not in f.tensors,
        weights_format="gguf",
        weights_path=f.path,
    )
    if rope_kind != "none":
        kw["rope_scaling_factor"] = float(f.require(f"{arch}.rope.scaling.factor"))
        orig = f.field(f"{arch}.rope.scaling.original_context_length")
        if orig:
            kw["rope_original_max_position_embeddings"] = int(orig)
    kw.update(overrides)
    try:
        return ModelConfig(**kw)
    except ConfigError as e:
        raise ModelLoadError(f.path, f"does not describe a valid model: {e}") from None


def load_gguf(
    path: str | Path | GGUFFile, *, mesh: Mesh | None = None, **overrides: Any
) -> tuple[ModelConfig, Transformer]:
    """Load a Llama/Qwen2/Qwen3 GGUF, dequantized to ``param_dtype`` (an override, default f32).

    With ``mesh``, parameters are created sharded by the rules table.
    """
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = config_from_gguf(f, **overrides)
    by_hf = {hf: name for name in f.tensors if (hf := hf_name(name)) is not None}

    def get(name: str) -> np.ndarray | None:
        if name not in by_hf:
            return None
        w = f.tensor(by_hf[name])
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            if w is not None and w.shape[0] % (2 * heads) == 0:
                w = unpermute_rope_rows(w, heads)
        return w

    # Unknown GGUF tensors keep their GGUF name so build_model reports them instead of dropping them.
    names = [hf_name(n) or n for n in f.tensors]
    return cfg, build_model(cfg, get, f.path, mesh, names=names)
