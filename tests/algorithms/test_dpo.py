"""Online DPO pair selection and loss, by hand."""

import numpy as np
import pytest

from rlax_tpu.algorithms.dpo import dpo_loss, select_pairs


def test_select_best_and_worst():
    rewards = np.array([[0.1, 0.9, 0.5], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    chosen, rejected, valid = select_pairs(rewards)
    np.testing.assert_array_equal(chosen, [1, 0, 1])  # first of the best on ties
    np.testing.assert_array_equal(rejected, [0, 0, 0])
    np.testing.assert_array_equal(valid, [True, False, True])


def test_dpo_loss_by_hand():
    # Pair (y_w = 1, y_l = 0): h = 0.5·[(−1 − (−2)) − (−3 − (−2))] = 0.5·2 = 1;
    # −log σ(1) = log(1 + e^{−1}) = 0.3132617. The all-equal group adds nothing.
    seq_logp = np.array([[-3.0, -1.0], [-5.0, -5.0]])
    seq_ref = np.array([[-2.0, -2.0], [0.0, 0.0]])
    rewards = np.array([[0.0, 1.0], [1.0, 1.0]])
    loss, metrics = dpo_loss(seq_logp, seq_ref, rewards, 0.5)
    assert float(loss) == pytest.approx(0.3132617, abs=1e-6)
    assert float(metrics["dpo_pairs"]) == 1.0
    assert float(metrics["dpo_margin_mean"]) == pytest.approx(1.0)
    assert float(metrics["dpo_accuracy"]) == 1.0
