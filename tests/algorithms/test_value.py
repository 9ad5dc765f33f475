"""PPO's clipped value loss, by hand."""

import numpy as np
import pytest

from rlax_tpu.algorithms.value import clipped_value_loss


def test_clipped_value_loss_by_hand():
    values = np.array([[1.0, 0.0, 0.55]])
    values_old = np.array([[0.5, 0.5, 0.5]])
    returns = np.array([[2.0, 0.2, 0.0]])
    weights = np.full((1, 3), 1 / 3)
    # token 0: unclipped (1 − 2)² = 1, clipped V = 0.7: 1.69 -> max 1.69
    # token 1: unclipped 0.04, clipped V = 0.3: 0.01 -> 0.04
    # token 2: |ΔV| = 0.05 inside the clip: 0.3025 both
    expected = 0.5 * (1.69 + 0.04 + 0.3025) / 3
    assert float(clipped_value_loss(values, values_old, returns, weights, 0.2)) == pytest.approx(
        expected, abs=1e-6
    )
