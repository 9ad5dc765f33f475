"""KL estimators against hand-computed numbers (r = π_ref/π_θ)."""

import numpy as np
import pytest

from rlax_tpu.algorithms.regularizers import kl_estimate

LN2 = 0.6931472
LOGP = np.log([[0.5, 0.2, 0.3]])
LOGP_REF = np.log([[0.25, 0.4, 0.3]])
MASK = np.ones((1, 3))


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # token 0: r = 0.5, log r = −ln 2; token 1: r = 2, log r = ln 2; token 2: r = 1.
        ("k1", [LN2, -LN2, 0.0]),
        ("k2", [0.5 * LN2**2, 0.5 * LN2**2, 0.0]),  # 0.2402265
        ("k3", [0.5 + LN2 - 1.0, 2.0 - LN2 - 1.0, 0.0]),  # 0.1931472, 0.3068528
    ],
)
def test_kl_estimators_by_hand(estimator, expected):
    np.testing.assert_allclose(kl_estimate(LOGP, LOGP_REF, MASK, estimator), [expected], atol=1e-6)


def test_padding_is_zero_even_if_garbage():
    out = kl_estimate(
        np.array([[-1.0, np.nan]]), np.array([[-1.0, -np.inf]]), np.array([[1.0, 0.0]]), "k3"
    )
    np.testing.assert_array_equal(out, [[0.0, 0.0]])


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(LOGP, LOGP_REF, MASK, "k4")
