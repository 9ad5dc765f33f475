"""TB's β schedule and VarGrad log Z, by hand."""

import jax
import numpy as np
import pytest

from rlax_tpu.algorithms.tb import tb_beta, tb_loss, vargrad_log_z


@pytest.mark.parametrize("step, beta", [(0, 0.012), (250, 0.008), (500, 0.004), (1000, 0.004)])
def test_linear_beta_schedule(step, beta):
    got = tb_beta(step, beta=0.012, beta_final=0.004, decay_steps=500)
    assert float(got) == pytest.approx(beta, abs=1e-9)


def test_constant_beta():
    assert float(tb_beta(10_000, beta=0.1, beta_final=0.004, decay_steps=0)) == pytest.approx(0.1)


def test_beta_schedule_under_jit():
    f = jax.jit(lambda s: tb_beta(s, beta=0.012, beta_final=0.004, decay_steps=500))
    assert float(f(250)) == pytest.approx(0.008, abs=1e-9)


def test_vargrad_log_z_by_hand():
    # log Ẑ = mean_i (r_i/β + log π_ref − log π_θ): (1/0.5 − 2 + 1, 0 − 2 + 3)/2 = (1 + 1)/2 = 1.
    seq_logp = np.array([[-1.0, -3.0]])
    seq_ref = np.array([[-2.0, -2.0]])
    rewards = np.array([[1.0, 0.0]])
    np.testing.assert_allclose(vargrad_log_z(seq_logp, seq_ref, rewards, 0.5), [1.0])
    loss, log_z = tb_loss(seq_logp, seq_ref, rewards, 0.5)
    assert float(loss) == 0.0  # both samples already balance at log Z = 1


def test_tb_loss_by_hand():
    # residuals d = log π_θ − log π_ref − r/β = (0 − 0 − 2, 1 − 0 − 0) = (−2, 1); log Ẑ = 0.5;
    # loss = ((0.5 − 2)² + (0.5 + 1)²)/2 = 2.25.
    loss, log_z = tb_loss(np.array([[0.0, 1.0]]), np.zeros((1, 2)), np.array([[1.0, 0.0]]), 0.5)
    assert float(log_z[0]) == pytest.approx(0.5)
    assert float(loss) == pytest.approx(2.25)
