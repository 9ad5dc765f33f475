"""PPO's clipped value loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clipped_value_loss(
    values: jax.Array,
    values_old: jax.Array,
    returns: jax.Array,
    weights: jax.Array,
    clip: float,
) -> jax.Array:
    """½ Σ w · max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²): scalar. Inputs [B, T]."""
    v_clipped = values_old + jnp.clip(values - values_old, -clip, clip)
    per_token = jnp.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    return 0.5 * (weights * per_token).sum()
