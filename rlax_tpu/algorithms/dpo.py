"""Online DPO on the best and worst sample of each group (Asynchronous RLHF, DESIGN §5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_pairs(rewards: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen, rejected, valid) per group from rewards [N, G]: indices [N] and a bool [N].

    chosen is the first highest-reward sample, rejected the first lowest. A group whose rewards are
    all equal has no preference: valid is False there and the pair carries no loss.
    """
    chosen = jnp.argmax(rewards, axis=1)
    rejected = jnp.argmin(rewards, axis=1)
    valid = rewards.max(axis=1) > rewards.min(axis=1)
    return chosen, rejected, valid


def dpo_loss(
    seq_logp: jax.Array, seq_logp_ref: jax.Array, rewards: jax.Array, beta: jax.Array | float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean over valid pairs of −log σ(β[(log π_θ − log π_ref)(y_w) − (log π_θ − log π_ref)(y_l)]).

    Inputs [N, G] (sequence log-probs are token sums). Returns (loss, metrics).
    """
    chosen, rejected, valid = select_pairs(rewards)
    log_ratio = seq_logp - seq_logp_ref

    def pick(x, idx):
        return jnp.take_along_axis(x, idx[:, None], axis=1)[:, 0]

    margin = beta * (pick(log_ratio, chosen) - pick(log_ratio, rejected))
    valid_f = valid.astype(margin.dtype)
    n = jnp.maximum(valid_f.sum(), 1)
    loss = (-jax.nn.log_sigmoid(margin) * valid_f).sum() / n
    sg = jax.lax.stop_gradient
    metrics = {
        "dpo_pairs": valid_f.sum(),
        "dpo_margin_mean": sg((margin * valid_f).sum() / n),
        "dpo_accuracy": sg(((margin > 0) * valid_f).sum() / n),
    }
    return loss, metrics
