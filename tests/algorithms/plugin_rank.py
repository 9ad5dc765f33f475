"""A user's own algorithm, as a plugin module (``--config.algorithm.plugins='("tests.algorithms.
plugin_rank",)'``): GRPO with rank-based advantages, a group estimator written here."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import register_advantage, register_algorithm


def centered_ranks(rewards: jax.Array) -> jax.Array:
    """[N, G] -> each reward's rank within its group (ties share the mean rank), centered and
    scaled to [-0.5, 0.5]."""
    g = rewards.shape[-1]
    below = (rewards[..., :, None] > rewards[..., None, :]).sum(-1)
    ties = (rewards[..., :, None] == rewards[..., None, :]).sum(-1)
    rank = below + (ties - 1) / 2.0
    return (rank / max(g - 1, 1) - 0.5).astype(jnp.result_type(rewards))


register_advantage("centered_rank", centered_ranks)
register_algorithm("rank_grpo", base="grpo", advantage="centered_rank", kl_estimator="none")
