"""Importance weights ω (never differentiated; callers pass stop-gradient log-probs).

Log-ratios are zeroed on padding before exponentiating, so garbage there cannot overflow.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

BehaviourCorrection = Literal["none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"]


def masked_log_ratio(logp_num: jax.Array, logp_den: jax.Array, mask: jax.Array) -> jax.Array:
    """log(p_num/p_den): [B, T], 0 on padding."""
    return jnp.where(mask > 0, logp_num - logp_den, 0.0)


def token_ratio(logp: jax.Array, logp_old: jax.Array, mask: jax.Array) -> jax.Array:
    """ρ = π_θ/π_old per token: [B, T] (1 on padding)."""
    return jnp.exp(masked_log_ratio(logp, logp_old, mask))


def clipped_ratio(ratio: jax.Array, eps_low: float, eps_high: float) -> jax.Array:
    """CISPO's weight clip(ρ, 1−ε_low, 1+ε_high): same shape as ratio."""
    return jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)


def truncated_ratio(
    logp: jax.Array, logp_behaviour: jax.Array, mask: jax.Array, cap: float
) -> jax.Array:
    """AIPO's weight min(π_θ/μ, c) per token: [B, T]."""
    return jnp.minimum(jnp.exp(masked_log_ratio(logp, logp_behaviour, mask)), cap)


def sequence_ratio(logp: jax.Array, logp_old: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO's length-normalized ratio (π_θ(o_i)/π_old(o_i))^{1/|o_i|}: [B]."""
    lengths = jnp.maximum(mask.sum(axis=1), 1)
    return jnp.exp(masked_log_ratio(logp, logp_old, mask).sum(axis=1) / lengths)


def behaviour_weights(
    logp_old: jax.Array,
    logp_behaviour: jax.Array,
    mask: jax.Array,
    mode: BehaviourCorrection,
    cap: float,
    floor: float = 0.0,
) -> jax.Array:
    """Correction for sampling from μ instead of π_old: [B, T], c = π_old/μ.

    token_*: c per token; seq_*: the sequence's length-normalized c = (Π_t π_old/μ)^{1/|o|}
    (the geometric mean, as GSPO's ratio: a raw product degenerates on long sequences),
    broadcast to its tokens. *_truncate: min(c, cap); *_mask: c inside the band
    floor <= c <= cap, else 0 (the token/sequence is dropped; IcePop's two-sided band, floor 0 =
    one-sided).
    """
    if mode == "none":
        return jnp.ones_like(logp_old)
    log_c = masked_log_ratio(logp_old, logp_behaviour, mask)
    if mode.startswith("seq_"):
        lengths = jnp.maximum(mask.sum(axis=1, keepdims=True), 1)
        log_c = jnp.broadcast_to(log_c.sum(axis=1, keepdims=True) / lengths, log_c.shape)
    c = jnp.exp(log_c)
    if mode.endswith("_truncate"):
        return jnp.minimum(c, cap)
    if mode.endswith("_mask"):
        return jnp.where((c >= floor) & (c <= cap), c, 0.0)
    raise ValueError(f"unknown behaviour correction {mode!r}")
