"""Flax NNX decoder-only transformer (Llama / Qwen2 / Qwen3), sharding rules, loaders, tokenizers.

Entry points:
  forward(model, tokens, positions=None) -> logits        full sequences (training, log-probs)
  step(model, tokens, positions, cache) -> logits, cache   chunked prefill / decode via a KVCache
  KVCache (Protocol), DenseKVCache, NoCache                attention backends (see attention.py)
  LOGICAL_AXIS_RULES, make_mesh, shard_model, param_shardings
  load_model(cfg, mesh=None), load_tokenizer(cfg)          from a run's ModelConfig
  load_safetensors / save_safetensors, load_gguf, Tokenizer
"""

from rlax_tpu.models.attention import (
    DenseKVCache,
    KVCache,
    NoCache,
    causal_mask,
    dot_product_attention,
)
from rlax_tpu.models.checkpoint import (
    abstract_model,
    build_model,
    load_safetensors,
    read_hf_config,
    save_safetensors,
)
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.generate import greedy_generate
from rlax_tpu.models.gguf_io import config_from_gguf, load_gguf
from rlax_tpu.models.hf_format import config_from_hf, config_to_hf
from rlax_tpu.models.loader import checkpoint_config, load_model, load_tokenizer
from rlax_tpu.models.presets import PRESETS, preset
from rlax_tpu.models.scoring import ReplayShape, replay_logprobs
from rlax_tpu.models.sharding import (
    LOGICAL_AXIS_RULES,
    constrain,
    logical_to_spec,
    make_mesh,
    param_shardings,
    shard_model,
)
from rlax_tpu.models.tokenizer import Tokenizer
from rlax_tpu.models.transformer import (
    REMAT_POLICIES,
    UNROLLED,
    LayerLoop,
    Routing,
    Transformer,
    default_positions,
    forward,
    init_model,
    make_dense_cache,
    step,
    token_logprobs,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "PRESETS",
    "REMAT_POLICIES",
    "DenseKVCache",
    "KVCache",
    "LayerLoop",
    "ModelLoadError",
    "UNROLLED",
    "NoCache",
    "ReplayShape",
    "Routing",
    "replay_logprobs",
    "Tokenizer",
    "Transformer",
    "abstract_model",
    "build_model",
    "causal_mask",
    "checkpoint_config",
    "config_from_gguf",
    "config_from_hf",
    "config_to_hf",
    "constrain",
    "default_positions",
    "dot_product_attention",
    "forward",
    "greedy_generate",
    "init_model",
    "load_gguf",
    "load_safetensors",
    "logical_to_spec",
    "load_model",
    "load_tokenizer",
    "make_dense_cache",
    "make_mesh",
    "param_shardings",
    "preset",
    "read_hf_config",
    "save_safetensors",
    "shard_model",
    "step",
    "token_logprobs",
]
