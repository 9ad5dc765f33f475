"""Aggregation weights w_{i,t} of Eq. 3, normalized over the whole batch."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Aggregation = Literal["seq_mean_token_mean", "token_mean", "max_length", "seq_mean_token_sum"]


def aggregation_weights(mask: jax.Array, kind: Aggregation, *, max_length: int) -> jax.Array:
    """Per-token weights w: [B, T] from mask: [B, T] (0 on padding).

    seq_mean_token_mean: 1/(B·|o_i|) (GRPO); token_mean: 1/Σ_j |o_j| (DAPO);
    max_length: 1/(B·L_max) (Dr.GRPO), L_max the generation budget; seq_mean_token_sum: 1/B
    (LUSPO: each sequence's loss scaled by its length).
    """
    b = mask.shape[0]
    if kind == "seq_mean_token_mean":
        lengths = jnp.maximum(mask.sum(axis=1, keepdims=True), 1)
        return mask / (b * lengths)
    if kind == "token_mean":
        return mask / jnp.maximum(mask.sum(), 1)
    if kind == "max_length":
        return mask / (b * max_length)
    if kind == "seq_mean_token_sum":
        return mask / b
    raise ValueError(f"unknown aggregation {kind!r}")
