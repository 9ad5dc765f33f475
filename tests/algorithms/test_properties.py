"""The distinctions RLAX §4.1 points out, pinned as properties of the gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.algorithms import RolloutBatch, make_objective
from rlax_tpu.config import AlgorithmConfig

# One group of G = 2: rewards (1, 0) give group-normalized advantages ±0.5/(std + 1e-6),
# std = √0.5 (sample std), so A = ±0.7071058.
A_POS = 0.5 / (np.sqrt(0.5) + 1e-6)
LOG_RATIO = np.log([[1.5, 1.1, 0.5], [0.5, 1.5, 0.9]])  # log π_θ/π_old per token
LOGP_OLD = np.log([[0.3, 0.2, 0.4], [0.3, 0.2, 0.4]])


def _batch(logp_behaviour=LOGP_OLD):
    return RolloutBatch(
        logp_old=LOGP_OLD,
        logp_behaviour=logp_behaviour,
        mask=np.ones((2, 3)),
        rewards=np.array([1.0, 0.0]),
    )


def _grad(name, batch, logp, **overrides):
    obj = make_objective(AlgorithmConfig(name=name, group_size=2, **overrides), max_length=3)
    inputs = obj.prepare(batch)
    return np.asarray(jax.grad(lambda lp: obj.loss(lp, inputs)[0])(jnp.asarray(logp)))


def test_grpo_clipped_tokens_have_zero_gradient(x64):
    # The policy-gradient part alone: GRPO's default KL term has a gradient of its own.
    grad = _grad("grpo", _batch(), LOGP_OLD + LOG_RATIO, kl_estimator="none")
    # Clipped: (0,0) has A > 0 and ρ = 1.5 > 1.2; (1,0) has A < 0 and ρ = 0.5 < 0.8.
    assert grad[0, 0] == 0.0 and grad[1, 0] == 0.0
    # Every other token keeps the PPO gradient −w·ρ·A with w = 1/(G·|o_i|) = 1/6.
    expected = -np.exp(LOG_RATIO) * np.array([[A_POS], [-A_POS]]) / 6
    keep = np.ones((2, 3), bool)
    keep[0, 0] = keep[1, 0] = False
    np.testing.assert_allclose(grad[keep], expected[keep], rtol=1e-12)


def test_cispo_clipped_tokens_keep_a_bounded_nonzero_gradient(x64):
    grad = _grad("cispo", _batch(), LOGP_OLD + LOG_RATIO)
    w = 1 / 6  # token mean over 6 tokens
    # ρ = 1.5 is clipped to 1 + ε_high = 1.28: gradient −w·1.28·A, not 0.
    assert grad[0, 0] == pytest.approx(-w * 1.28 * A_POS, rel=1e-12)
    assert grad[1, 1] == pytest.approx(-w * 1.28 * -A_POS, rel=1e-12)
    assert grad[1, 0] == pytest.approx(-w * 0.5 * -A_POS, rel=1e-12)  # no lower bound
    assert (grad != 0).all()
    assert (np.abs(grad) <= w * 1.28 * A_POS + 1e-15).all()


def test_aipo_ratio_above_cap_gets_weight_cap(x64):
    logp = LOGP_OLD + LOG_RATIO
    # π_θ/μ = 3 on (0,0) and (1,1), 1.5 elsewhere; cap 2.
    ratio_mu = np.array([[3.0, 1.5, 1.5], [1.5, 3.0, 1.5]])
    grad = _grad("aipo", _batch(logp - np.log(ratio_mu)), logp, is_cap=2.0)
    w = 1 / (2 * 3)  # 1/(B·L_max)
    adv = np.array([[0.5], [-0.5]])  # r − group mean
    np.testing.assert_allclose(grad, -w * np.minimum(ratio_mu, 2.0) * adv, rtol=1e-12)


PPO_FAMILY = ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "reinforce_pp", "ppo", "aipo"]


@settings(max_examples=8, derandomize=True, deadline=None)
@given(
    name=st.sampled_from(PPO_FAMILY),
    seed=st.integers(0, 2**16),
    groups=st.integers(1, 3),
    group_size=st.integers(2, 4),
    length=st.integers(1, 6),
    correction=st.sampled_from(["none", "token_truncate", "seq_mask"]),
)
def test_on_policy_every_ratio_is_one_and_the_objective_is_reinforce(
    name, seed, groups, group_size, length, correction
):
    from .conftest import random_batch

    previous = jax.config.jax_enable_x64  # a fixture would not be reset per example
    jax.config.update("jax_enable_x64", True)
    try:
        batch, _, _ = random_batch(seed, groups=groups, group_size=group_size, length=length)
        batch = RolloutBatch(
            logp_old=batch.logp_old,
            logp_behaviour=batch.logp_old,  # μ = π_old
            mask=batch.mask,
            rewards=batch.rewards,
            logp_ref=batch.logp_ref,
            values=batch.values,
        )
        logp = jnp.asarray(np.where(batch.mask > 0, batch.logp_old, -np.inf))  # π_θ = π_old
        if name == "aipo" and correction != "none":
            correction = "none"  # aipo corrects for μ itself
        # Without a KL regularizer (GRPO's default has one): the property is about the PG term.
        cfg = AlgorithmConfig(
            name=name, group_size=group_size, behaviour_correction=correction, kl_estimator="none"
        )
        obj = make_objective(cfg, max_length=length)
        inputs = obj.prepare(batch)
        values = jnp.asarray(np.nan_to_num(batch.values))

        grad, metrics = jax.grad(lambda lp: obj.loss(lp, inputs, values=values), has_aux=True)(logp)

        assert metrics["ratio_mean"] == 1.0 and metrics["ratio_max"] == 1.0
        assert metrics["importance_weight_mean"] == 1.0
        assert metrics["behaviour_weight_mean"] == 1.0
        assert metrics["clip_fraction"] == 0.0
        # REINFORCE with the algorithm's own advantage and aggregation: ∇ = −w·A.
        expected = -np.asarray(inputs.agg_weight * inputs.advantages)
        np.testing.assert_allclose(grad, expected, atol=1e-15, rtol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", previous)
