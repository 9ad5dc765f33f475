"""Importance weights ω (never differentiated; callers pass stop-gradient log-probs).

Log-ratios are zeroed on padding before exponentiating, so garbage there cannot overflow.
"""

from __future__ import annotations

import math
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


def sapo_gate(
    ratio: jax.Array, advantages: jax.Array, tau_pos: float, tau_neg: float
) -> tuple[jax.Array, jax.Array]:
    """SAPO's soft gate f(ρ) = (4/τ)·σ(τ(ρ − 1)), τ by the advantage's sign: (f, df/dlog ρ =
    4·σ·(1 − σ)·ρ), both [B, T]. f replaces PPO's hard clip: its slope peaks at ρ = 1 (the
    on-policy gradient) and fades smoothly off-policy."""
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    sig = jax.nn.sigmoid(tau * (ratio - 1.0))
    return 4.0 / tau * sig, 4.0 * sig * (1.0 - sig) * ratio


def vespo_weight(
    logp: jax.Array,
    logp_old: jax.Array,
    mask: jax.Array,
    positive: jax.Array,
    k: tuple[float, float],
    lam: tuple[float, float],
) -> jax.Array:
    """VESPO's Gamma weight φ(w) = e^λ·w^k·e^{−λw} (φ(1) = 1) of the sequence ratio w =
    Π_t π_θ/π_old (log-ratios clamped to ±20, log w to [log 1e-8, 20]); (k, λ) = k[0], lam[0]
    where ``positive`` [B] (advantage >= 0), else k[1], lam[1]. Returns [B]."""
    log_ratio = jnp.clip(masked_log_ratio(logp, logp_old, mask), -20.0, 20.0)
    log_w = jnp.clip(log_ratio.sum(axis=1), math.log(1e-8), 20.0)
    kk = jnp.where(positive, k[0], k[1])
    ll = jnp.maximum(jnp.where(positive, lam[0], lam[1]), 1e-4)
    phi = jnp.exp(ll + kk * log_w - ll * jnp.exp(log_w))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


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
