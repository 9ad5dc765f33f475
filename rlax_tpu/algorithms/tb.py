"""Trajectory balance with a VarGrad log Z (TBA, DESIGN §5). Sequence log-probs are token sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tb_beta(
    step: int | jax.Array, *, beta: float, beta_final: float, decay_steps: int
) -> jax.Array:
    """β at a training step: linear from beta to beta_final over decay_steps, then constant."""
    if decay_steps == 0:
        return jnp.asarray(beta)
    frac = jnp.clip(jnp.asarray(step) / decay_steps, 0.0, 1.0)
    return beta + (beta_final - beta) * frac


def _residuals(seq_logp, seq_logp_ref, rewards, beta):
    return seq_logp - seq_logp_ref - rewards / beta


def vargrad_log_z(
    seq_logp: jax.Array, seq_logp_ref: jax.Array, rewards: jax.Array, beta: jax.Array | float
) -> jax.Array:
    """log Ẑ = mean_i (r_i/β + log π_ref(o_i) − log π_θ(o_i)) per group: [N, G] inputs -> [N]."""
    return -_residuals(seq_logp, seq_logp_ref, rewards, beta).mean(axis=1)


def tb_loss(
    seq_logp: jax.Array, seq_logp_ref: jax.Array, rewards: jax.Array, beta: jax.Array | float
) -> tuple[jax.Array, jax.Array]:
    """(loss, log Ẑ): mean over groups of 1/G Σ_i (sg(log Ẑ) + log π_θ − log π_ref − r_i/β)².

    Inputs [N, G]; log Ẑ: [N]. Stopping the gradient through log Ẑ leaves the gradient unchanged
    (the residuals sum to 0 per group) and avoids differentiating the mean.
    """
    log_z = jax.lax.stop_gradient(vargrad_log_z(seq_logp, seq_logp_ref, rewards, beta))
    d = log_z[:, None] + _residuals(seq_logp, seq_logp_ref, rewards, beta)
    return (d**2).mean(), log_z
