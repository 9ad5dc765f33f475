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
        # seq_*: the geometric mean (5 · 0.5)^(1/2) = √2.5 over the 2 real tokens, not Π = 2.5.
        ("seq_truncate", [[np.sqrt(2.5), np.sqrt(2.5)]]),
        ("seq_mask", [[np.sqrt(2.5), np.sqrt(2.5)]]),
    ],
)
def test_behaviour_weights(mode, expected):
    out = I.behaviour_weights(LOGP_OLD, LOGP_MU, MASK, mode, cap=2.0)
    np.testing.assert_allclose(np.asarray(out)[:, :2], expected, atol=1e-6)  # real tokens


def test_behaviour_seq_mask_drops_whole_sequences_outside_the_band():
    w = lambda **kw: np.asarray(I.behaviour_weights(LOGP_OLD, LOGP_MU, MASK, "seq_mask", **kw))
    np.testing.assert_allclose(w(cap=1.5)[:, :2], [[0.0, 0.0]])  # √2.5 > cap
    np.testing.assert_allclose(w(cap=2.0, floor=1.6)[:, :2], [[0.0, 0.0]])  # √2.5 < floor
    np.testing.assert_allclose(w(cap=2.0, floor=1.5)[:, :2], [[np.sqrt(2.5)] * 2], atol=1e-6)


def test_behaviour_token_mask_two_sided_band():
    w = lambda floor: np.asarray(
        I.behaviour_weights(LOGP_OLD, LOGP_MU, MASK, "token_mask", cap=2.0, floor=floor)
    )[:, :2]
    np.testing.assert_allclose(w(0.4), [[0.0, 0.5]], atol=1e-6)  # 5 > cap dropped, 0.5 kept
    np.testing.assert_allclose(w(0.6), [[0.0, 0.0]])  # 0.5 < floor: dropped too


def test_seq_correction_is_length_invariant():
    """The same per-token mismatch gives the same c for 2 tokens and for 200 (a raw product
    would be 1.1^200 ≈ 2e8)."""
    for n in (2, 200):
        mask = np.ones((1, n))
        c = I.behaviour_weights(
            np.full((1, n), np.log(1.1)), np.zeros((1, n)), mask, "seq_truncate", cap=10.0
        )
        np.testing.assert_allclose(np.asarray(c), 1.1, rtol=1e-5)
