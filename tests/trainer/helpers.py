"""Shared builders for the trainer tests: small run configs and random TrainBatches."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlax_tpu import models
from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    RunConfig,
    TrainerConfig,
)
from rlax_tpu.types import TrainBatch

ROWS, GROUP, WIDTH = 16, 4, 24  # rows per batch, group size, completion columns
MAX_PROMPT, MAX_NEW = 16, 24


def run_config(
    mesh: tuple[int, int, int] = (1, 1, 1),
    *,
    algorithm: str = "grpo",
    model: Any = None,
    slices: int = 1,
    **trainer: Any,
) -> RunConfig:
    """A tiny-model run (2 layers, for compile time): 16 rollouts (4 prompts x 4 samples) per step in micro-batches of 8."""
    trainer = (
        dict(learning_rate=1e-3, micro_batch_size=8, length_bucket=64, align_logprobs=False)
        | trainer
    )
    return RunConfig(
        model=model or models.preset("tiny", num_layers=2),
        mesh=MeshConfig(data=mesh[0], fsdp=mesh[1], tensor=mesh[2], slices=slices),
        trainer=TrainerConfig(**trainer),
        inference=InferenceConfig(
            prefill_chunk=8, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW
        ),
        controller=ControllerConfig(prompts_per_step=ROWS // GROUP, num_steps=10),
        algorithm=AlgorithmConfig(name=algorithm, group_size=GROUP),
    )


def random_batch(
    seed: int, *, rows: int = ROWS, vocab: int = 512, version: int = 0, **replace: Any
) -> TrainBatch:
    """Random prompts (2..MAX_PROMPT tokens) and completions (1..WIDTH tokens)."""
    r = np.random.default_rng(seed)
    prompt = r.integers(2, MAX_PROMPT + 1, rows).astype(np.int32)
    completion = r.integers(1, WIDTH + 1, rows).astype(np.int32)
    tokens = r.integers(0, vocab, (rows, int((prompt + completion).max()))).astype(np.int32)
    batch = TrainBatch(
        tokens=tokens,
        prompt_lengths=prompt,
        completion_lengths=completion,
        behaviour_logprobs=-r.uniform(5.0, 7.0, (rows, WIDTH)).astype(np.float32),
        rewards=r.integers(0, 2, rows).astype(np.float32),
        versions=np.full(rows, version),
        group_size=GROUP,
    )
    return dataclasses.replace(batch, **replace) if replace else batch


def host(tree: Any) -> Any:
    """A pytree of jax arrays as numpy arrays (gathered)."""
    import jax

    return jax.tree.map(np.asarray, tree)
