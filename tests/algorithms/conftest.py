"""Fixtures for the algorithm tests: float64 mode and seeded random padded batches."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_tpu.algorithms import RolloutBatch


@pytest.fixture
def x64():
    """float64 for gradient comparisons; restored afterwards."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def random_batch(
    seed: int,
    *,
    groups: int = 3,
    group_size: int = 4,
    length: int = 7,
    spread: float = 0.3,
    behaviour_spread: float = 0.2,
) -> tuple[RolloutBatch, np.ndarray, np.ndarray]:
    """(batch, current logp, lengths): float64, ragged lengths in [1, length].

    Padding holds NaN in the batch and -inf in logp, so anything that leaks from it shows.
    spread sets |log π_θ − log π_old|, behaviour_spread |log π_old − log μ|.
    """
    rng = np.random.default_rng(seed)
    b = groups * group_size
    lengths = rng.integers(1, length + 1, size=b)
    lengths[0] = length  # at least one full row
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)

    def padded(x, pad):
        return np.where(mask > 0, x, pad)

    logp_old = -rng.gamma(2.0, 0.7, size=(b, length))
    logp = logp_old + spread * rng.normal(size=(b, length))
    batch = RolloutBatch(
        logp_old=padded(logp_old, np.nan),
        logp_behaviour=padded(logp_old + behaviour_spread * rng.normal(size=(b, length)), np.nan),
        mask=mask,
        rewards=rng.normal(size=b),
        logp_ref=padded(logp_old + 0.3 * rng.normal(size=(b, length)), np.nan),
        values=padded(rng.normal(size=(b, length)), np.nan),
    )
    return batch, padded(logp, -np.inf), lengths


@pytest.fixture
def make_batch():
    return random_batch
