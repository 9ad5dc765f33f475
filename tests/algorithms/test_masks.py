"""PPO clipping as a gradient mask, case by case."""

import numpy as np
import pytest

from rlax_tpu.algorithms.masks import ppo_clip_mask


@pytest.mark.parametrize(
    "ratio, adv, expected",
    [
        (1.3, 1.0, 0.0),  # A > 0, ρ > 1 + ε_high: clipped
        (1.1, 1.0, 1.0),
        (0.5, 1.0, 1.0),  # A > 0 and ρ small: the min picks ρA, gradient flows
        (0.7, -1.0, 0.0),  # A < 0, ρ < 1 − ε_low: clipped
        (0.9, -1.0, 1.0),
        (1.5, -1.0, 1.0),  # A < 0 and ρ large: gradient flows
        (1.5, 0.0, 1.0),
    ],
)
def test_mask_cases(ratio, adv, expected):
    out = ppo_clip_mask(np.array([ratio]), np.array([adv]), eps_low=0.2, eps_high=0.28)
    assert float(out[0]) == expected


def test_asymmetric_bounds():
    ratio = np.array([1.25, 1.25, 0.75, 0.85])
    adv = np.array([1.0, 1.0, -1.0, -1.0])
    np.testing.assert_array_equal(ppo_clip_mask(ratio, adv, 0.2, 0.28), [1.0, 1.0, 0.0, 1.0])
    np.testing.assert_array_equal(ppo_clip_mask(ratio, adv, 0.1, 0.2), [0.0, 0.0, 0.0, 0.0])
