"""Gradient masks M of Eq. 3."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ppo_clip_mask(
    ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float
) -> jax.Array:
    """PPO clipping as a mask (MiniMax-M1 Eq. 7): 0 where A>0, ρ>1+ε_high or A<0, ρ<1−ε_low.

    ratio and advantages broadcast together (token ρ with [B, T] advantages, or a sequence ratio
    [B, 1] with them for GSPO's per-sequence mask). Returns 1.0/0.0 of the broadcast shape.
    """
    clipped = ((advantages > 0) & (ratio > 1.0 + eps_high)) | (
        (advantages < 0) & (ratio < 1.0 - eps_low)
    )
    return jnp.where(clipped, 0.0, 1.0).astype(jnp.result_type(ratio))
