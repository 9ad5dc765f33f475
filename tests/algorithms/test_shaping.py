"""DAPO dynamic sampling and overlong shaping, by hand."""

import numpy as np
import pytest

from rlax_tpu.algorithms.shaping import dynamic_sampling_filter, overlong_penalty


def test_dynamic_sampling_drops_all_equal_groups():
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.2, 0.3, 0.2]])
    keep, dropped = dynamic_sampling_filter(rewards)
    np.testing.assert_array_equal(keep, [False, True, False, True])
    assert dropped == 2


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ValueError, match=r"rewards must be \[num_groups, G\], got shape \(4,\)"):
        dynamic_sampling_filter(np.zeros(4))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_dynamic_sampling_refuses_non_finite_rewards(bad):
    rewards = np.array([[0.0, 1.0], [1.0, bad], [0.0, 0.0]])
    with pytest.raises(
        ValueError, match=rf"rewards of group 1 \(sample 1\) is {bad}: rewards must be finite"
    ):
        dynamic_sampling_filter(rewards)


def test_overlong_penalty_by_hand():
    # L_max = 20, buffer 5: free up to 15, then (15 − L)/5 down to −1 at 20.
    lengths = np.array([10, 15, 16, 18, 20, 25])
    np.testing.assert_allclose(
        overlong_penalty(lengths, max_length=20, buffer=5), [0, 0, -0.2, -0.6, -1.0, -1.0]
    )
    np.testing.assert_allclose(
        overlong_penalty(lengths, max_length=20, buffer=5, penalty=0.5),
        [0, 0, -0.1, -0.3, -0.5, -0.5],
    )


def test_overlong_buffer_must_fit():
    with pytest.raises(
        ValueError, match=r"overlong buffer must be in \(0, max_length=20\], got 21"
    ):
        overlong_penalty(np.array([1]), max_length=20, buffer=21)
