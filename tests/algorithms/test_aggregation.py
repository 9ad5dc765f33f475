"""Aggregation weights against hand-computed numbers."""

import numpy as np
import pytest

from rlax_tpu.algorithms.aggregation import aggregation_weights

MASK = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("seq_mean_token_mean", [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]),  # 1/(B·|o_i|), B = 2
        ("token_mean", [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]]),  # 1/Σ|o_j| = 1/3
        ("max_length", [[0.125, 0.125, 0.0], [0.125, 0.0, 0.0]]),  # 1/(B·L_max), L_max = 4
    ],
)
def test_weights_by_hand(kind, expected):
    np.testing.assert_allclose(aggregation_weights(MASK, kind, max_length=4), expected, atol=1e-7)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        aggregation_weights(MASK, "sum", max_length=4)
