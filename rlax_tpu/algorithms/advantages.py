"""Advantage estimators A of Eq. 3. Group estimators take rewards laid out [N, G]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def group_normalized(rewards: jax.Array, eps: float = GROUP_STD_EPS) -> jax.Array:
    """GRPO: (r_i − mean)/(std + eps) within each group: [N, G] -> [N, G].

    std is the sample standard deviation (ddof=1), as in TRL and verl; G must be >= 2. eps
    (``algorithm.group_std_eps``) defaults to verl's 1e-6; TRL's GRPOTrainer adds 1e-4.
    """
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    std = jnp.sqrt((centered**2).sum(axis=1, keepdims=True) / (rewards.shape[1] - 1))
    return centered / (std + eps)


def batch_scaled(rewards: jax.Array, eps: float = GROUP_STD_EPS) -> jax.Array:
    """Batch reward scaling (PPO Lite; TRL's scale_rewards="batch"): (r_i − group mean) / (std
    of the whole batch's rewards + eps), std with ddof=1: [N, G] -> [N, G]. Unlike group_norm,
    a group with nearly equal rewards is not amplified."""
    flat = rewards.reshape(-1)
    std = jnp.sqrt(((flat - flat.mean()) ** 2).sum() / max(flat.shape[0] - 1, 1))
    return group_centered(rewards) / (std + eps)


def group_centered(rewards: jax.Array) -> jax.Array:
    """Dr.GRPO / AIPO: r_i − mean of the group: [N, G] -> [N, G]."""
    return rewards - rewards.mean(axis=1, keepdims=True)


def leave_one_out(rewards: jax.Array) -> jax.Array:
    """RLOO: r_i − mean_{j≠i} r_j: [N, G] -> [N, G] (G >= 2)."""
    g = rewards.shape[1]
    others = (rewards.sum(axis=1, keepdims=True) - rewards) / (g - 1)
    return rewards - others


def whiten(x: jax.Array, mask: jax.Array, eps: float = WHITEN_EPS) -> jax.Array:
    """(x − mean)/(std + eps) over the real tokens of the whole batch: [B, T] (0 on padding)."""
    n = jnp.maximum(mask.sum(), 1)
    mean = (x * mask).sum() / n
    std = jnp.sqrt((((x - mean) * mask) ** 2).sum() / n)
    return (x - mean) / (std + eps) * mask


def last_token(mask: jax.Array) -> jax.Array:
    """One-hot of each row's last real token: [B, T] (all zero for an empty row)."""
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1], axis=1)
    dtype = jnp.result_type(mask)
    return jax.nn.one_hot(last, t, dtype=dtype) * (mask.sum(axis=1, keepdims=True) > 0)


def token_rewards(
    rewards: jax.Array, mask: jax.Array, kl: jax.Array | None = None, kl_coef: float = 0.0
) -> jax.Array:
    """Per-token reward r_t = −β·kl_t, plus the sequence reward at the last token: [B, T].

    rewards: [B]; kl: [B, T] per-token KL (e.g. log π_old − log π_ref) or None.
    """
    out = rewards[:, None] * last_token(mask)
    if kl is not None:
        out = out - kl_coef * kl * mask
    return out


def _reverse_scan(step, init: jax.Array, xs: tuple) -> jax.Array:
    """Runs ``carry = step(carry, x_t)`` from t = T−1 down to 0 over [B, T] inputs; stacks carries."""
    xs_t = tuple(x.T for x in xs)
    _, out = jax.lax.scan(lambda c, x: (step(c, x),) * 2, init, xs_t, reverse=True)
    return out.T


def returns_to_go(rewards_t: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over real tokens: [B, T] (REINFORCE++, Eq. 12)."""

    def step(carry, x):
        r, m = x
        return (r + gamma * carry) * m

    return _reverse_scan(step, jnp.zeros_like(rewards_t[:, 0]), (rewards_t, mask))


def gae(
    rewards_t: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation. Inputs [B, T]; returns (advantages, returns), [B, T].

    δ_t = r_t + γ V_{t+1} − V_t with V = 0 past the last real token;
    A_t = δ_t + γλ A_{t+1};  returns_t = A_t + V_t. Both are 0 on padding. Each row's real
    tokens must be a prefix (a completion is contiguous); a hole would cut the recursion.
    """
    values = values * mask
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = (rewards_t + gamma * next_values - values) * mask

    def step(carry, x):
        d, m = x
        return (d + gamma * lam * carry) * m

    adv = _reverse_scan(step, jnp.zeros_like(deltas[:, 0]), (deltas, mask))
    return adv, (adv + values) * mask
