from __future__ import annotations

import pytest

from rlax_tpu.data.evaluation import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (10, 0, 1, 0.0),
        (10, 10, 1, 1.0),
        (10, 3, 1, 0.3),  # c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (8, 2, 4, 1 - 15 / 70),  # C(6,4)=15, C(8,4)=70
        (3, 2, 2, 1.0),  # n - c < k: every draw of 2 contains a pass
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_mean_pass_at_k():
    assert mean_pass_at_k([0, 1, 2], n=4, k=2) == pytest.approx((0 + 0.5 + (1 - 1 / 6)) / 3)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], n=4, k=1)
