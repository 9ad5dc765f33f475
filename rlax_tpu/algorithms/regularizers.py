"""Regularizers R of Eq. 3: per-token KL(π_θ‖π_ref) estimators with r = π_ref/π_θ."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(
    logp: jax.Array, logp_ref: jax.Array, mask: jax.Array, estimator: KLEstimator
) -> jax.Array:
    """Per-token estimate: [B, T], 0 on padding. With log r = log π_ref − log π_θ:

    k1 = −log r;  k2 = ½ (log r)²;  k3 = r − log r − 1 (non-negative, unbiased).
    """
    log_r = jnp.where(mask > 0, logp_ref - logp, 0.0)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return jnp.exp(log_r) - log_r - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")
