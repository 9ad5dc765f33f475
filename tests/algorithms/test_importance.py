"""Importance weights and the behaviour-vs-old correction, by hand."""

import numpy as np
import pytest

from rlax_tpu.algorithms import importance as I

MASK = np.array([[1.0, 1.0, 0.0]])
LOGP_OLD = np.log([[0.5, 0.2, 0.9]])
LOGP_MU = np.log([[0.1, 0.4, np.nan]])  # π_old/μ = 5, 0.5; padding is NaN


def test_token_ratio_and_clip():
    ratio = I.token_ratio(np.log([[0.6, 0.1, 0.3]]), LOGP_OLD, MASK)
    np.testing.assert_allclose(ratio, [[1.2, 0.5, 1.0]], atol=1e-6)
    np.testing.assert_allclose(I.clipped_ratio(ratio, 0.2, 0.1), [[1.1, 0.8, 1.0]], atol=1e-6)


def test_truncated_ratio():
    out = I.truncated_ratio(np.log([[0.5, 0.2, 1e-9]]), LOGP_MU, MASK, cap=2.0)
    np.testing.assert_allclose(out, [[2.0, 0.5, 1.0]], atol=1e-6)  # 5 capped at 2


def test_sequence_ratio_is_geometric_mean():
    logp = np.log([[0.5 * 4.0, 0.2 * 0.25 * 4.0, 0.1]])  # token ratios 4 and 1
    np.testing.assert_allclose(I.sequence_ratio(logp, LOGP_OLD, MASK), [2.0], atol=1e-6)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("none", [[1.0, 1.0]]),
        ("token_truncate", [[2.0, 0.5]]),
        ("token_mask", [[0.0, 0.5]]),  # 5 > cap: dropped
        ("seq_truncate", [[2.0, 2.0]]),  # Π = 2.5, capped at 2
        ("seq_mask", [[0.0, 0.0]]),  # 2.5 > cap: the whole sequence is dropped
    ],
)
def test_behaviour_weights(mode, expected):
    out = I.behaviour_weights(LOGP_OLD, LOGP_MU, MASK, mode, cap=2.0)
    np.testing.assert_allclose(np.asarray(out)[:, :2], expected, atol=1e-6)  # real tokens


def test_behaviour_seq_mask_keeps_sequences_under_cap():
    out = I.behaviour_weights(LOGP_OLD, LOGP_MU, MASK, "seq_mask", cap=3.0)
    np.testing.assert_allclose(np.asarray(out)[:, :2], [[2.5, 2.5]], atol=1e-6)
