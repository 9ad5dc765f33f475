"""Advantage estimators against hand-computed numbers."""

import numpy as np
import pytest

from rlax_tpu.algorithms import advantages as A


def test_group_normalized_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]])
    # Group 0: mean 0.5, sample std sqrt(4·0.25/3) = 0.577350, so ±0.5/0.577350 = ±0.866025.
    # Group 1: mean 2.75, squared deviations 3·0.5625 + 5.0625 = 6.75, /3 = 2.25, std 1.5.
    expected = [[0.866025, -0.866025, -0.866025, 0.866025], [-0.5, -0.5, -0.5, 1.5]]
    np.testing.assert_allclose(A.group_normalized(rewards), expected, atol=1e-5)


def test_group_normalized_all_equal_group_is_zero():
    np.testing.assert_array_equal(A.group_normalized(np.full((1, 4), 3.0)), np.zeros((1, 4)))


def test_group_centered_by_hand():
    np.testing.assert_allclose(
        A.group_centered(np.array([[1.0, 0.0, 0.0, 1.0]])), [[0.5, -0.5, -0.5, 0.5]]
    )


def test_leave_one_out_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]])
    # r_0 = 1, others (0 + 0 + 1)/3 = 1/3 -> 2/3;  r_1 = 0, others (1 + 0 + 1)/3 -> -2/3.
    # r_0 = 2, others (2 + 2 + 5)/3 = 3 -> -1;  r_3 = 5, others 2 -> 3.
    expected = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1.0, -1.0, -1.0, 3.0]]
    np.testing.assert_allclose(A.leave_one_out(rewards), expected, atol=1e-6)


def test_gae_by_hand():
    rewards_t = np.array([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = np.array([[0.5, 0.4, 0.8], [1.0, 0.5, 9.0]])  # 9.0 sits on padding
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = A.gae(rewards_t, values, mask, gamma=0.9, lam=0.8)
    # Row 0: δ2 = 1 − 0.8 = 0.2, δ1 = 0.9·0.8 − 0.4 = 0.32, δ0 = 0.9·0.4 − 0.5 = −0.14;
    #   A2 = 0.2, A1 = 0.32 + 0.72·0.2 = 0.464, A0 = −0.14 + 0.72·0.464 = 0.19408.
    # Row 1 (length 2): δ1 = 2 − 0.5 = 1.5, δ0 = 0.9·0.5 − 1.0 = −0.55;
    #   A1 = 1.5, A0 = −0.55 + 0.72·1.5 = 0.53.
    np.testing.assert_allclose(adv, [[0.19408, 0.464, 0.2], [0.53, 1.5, 0.0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[0.69408, 0.864, 1.0], [1.53, 2.0, 0.0]], atol=1e-6)


def test_gae_lambda_one_is_return_minus_value():
    rewards_t = np.array([[0.0, 0.0, 1.0]])
    values = np.array([[0.3, 0.2, 0.1]])
    adv, _ = A.gae(rewards_t, values, np.ones((1, 3)), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[0.7, 0.8, 0.9]], atol=1e-6)


def test_token_rewards_and_returns_to_go_by_hand():
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kl = np.array([[0.1, -0.2, 0.3], [0.5, 7.0, 7.0]])
    r_t = A.token_rewards(np.array([1.0, -1.0]), mask, kl, kl_coef=0.5)
    # −0.5·kl per token, sequence reward added at the last real token.
    np.testing.assert_allclose(r_t, [[-0.05, 0.1, 0.85], [-1.25, 0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(
        A.returns_to_go(r_t, mask, gamma=1.0), [[0.9, 0.95, 0.85], [-1.25, 0.0, 0.0]], atol=1e-6
    )


def test_whiten_by_hand():
    x = np.array([[1.0, 3.0], [5.0, 100.0]])
    mask = np.array([[1.0, 1.0], [1.0, 0.0]])
    # Real values 1, 3, 5: mean 3, population std sqrt(8/3) = 1.632993.
    np.testing.assert_allclose(A.whiten(x, mask), [[-1.224745, 0.0], [1.224745, 0.0]], atol=1e-5)


@pytest.mark.parametrize("g", [2, 3, 5])
def test_leave_one_out_is_scaled_centered(g):
    rewards = np.random.default_rng(g).normal(size=(4, g))
    np.testing.assert_allclose(
        A.leave_one_out(rewards), A.group_centered(rewards) * g / (g - 1), atol=1e-5
    )


def test_group_std_eps_is_configurable_and_reaches_the_objective():
    """algorithm.group_std_eps: verl's 1e-6 by default, TRL's 1e-4 on request: a group whose
    rewards differ by 1e-4 gets advantages ±0.71 with 1e-6 and ±0.35 with 1e-4 (std 1.41e-4)."""
    import jax.numpy as jnp

    from rlax_tpu.algorithms import RolloutBatch, make_objective
    from rlax_tpu.config import AlgorithmConfig

    rewards = np.array([0.0, 1e-4], np.float32)
    std = np.std(rewards, ddof=1)
    for eps in (1e-6, 1e-4):
        cfg = AlgorithmConfig(name="grpo", group_size=2, group_std_eps=eps, kl_estimator="none")
        obj = make_objective(cfg, max_length=4)
        mask = jnp.ones((2, 4), jnp.float32)
        batch = RolloutBatch(
            logp_old=-mask,
            logp_behaviour=-mask,
            mask=mask,
            rewards=jnp.asarray(rewards),
            logp_ref=None,
            values=None,
        )
        adv = np.asarray(obj.prepare(batch).advantages)[:, 0]
        want = (rewards - rewards.mean()) / (std + eps)
        np.testing.assert_allclose(adv, want, rtol=1e-4)  # f32
    assert AlgorithmConfig().group_std_eps == 1e-6
