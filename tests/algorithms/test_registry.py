"""algorithm.name -> configured objective: paper defaults, overrides and unresolvable configs."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tpu.algorithms import make_objective
from rlax_tpu.config import ALGORITHMS, AlgorithmConfig, ConfigError


def spec(max_length=100, **kw):
    return make_objective(AlgorithmConfig(**kw), max_length=max_length).spec


def test_every_configurable_name_is_registered():
    for name in ALGORITHMS:
        assert spec(name=name).name == name


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "grpo",
            dict(
                aggregation="seq_mean_token_mean",
                advantage="group_norm",
                importance="ratio",
                clip_mask=True,
                eps_low=0.2,
                eps_high=0.2,
                kl_estimator="k3",
                kl_coef=0.04,
            ),
        ),
        (
            "dapo",
            dict(
                aggregation="token_mean",
                advantage="group_norm",
                eps_low=0.2,
                eps_high=0.28,
                dynamic_sampling=True,
                overlong_buffer=20,
                kl_estimator="none",
            ),
        ),
        (
            "dr_grpo",
            dict(aggregation="max_length", advantage="group_center", eps_low=0.2, eps_high=0.2),
        ),
        (
            "gspo",
            dict(
                importance="sequence_ratio",
                clip_mask=True,
                eps_low=3e-4,
                eps_high=4e-4,
                advantage="group_norm",
            ),
        ),
        (
            "cispo",
            dict(
                importance="clipped_ratio",
                clip_mask=False,
                eps_low=1.0,
                eps_high=0.28,
                aggregation="token_mean",
            ),
        ),
        (
            "reinforce",
            dict(importance="one", clip_mask=False, advantage="reward", aggregation="max_length"),
        ),
        ("rloo", dict(importance="one", clip_mask=False, advantage="leave_one_out")),
        (
            "reinforce_pp",
            dict(
                advantage="batch_norm_kl_reward",
                reward_kl_coef=0.01,
                eps_low=0.2,
                aggregation="token_mean",
            ),
        ),
        (
            "ppo",
            dict(
                advantage="gae",
                reward_kl_coef=0.05,
                value_coef=0.1,
                value_clip=0.2,
                gamma=1.0,
                gae_lambda=0.95,
            ),
        ),
        (
            "aipo",
            dict(importance="truncated", is_cap=5.0, clip_mask=False, advantage="group_center"),
        ),
        ("tb", dict(kind="tb", beta=0.012, beta_final=0.004, beta_decay_steps=500)),
        ("online_dpo", dict(kind="online_dpo", beta=0.1, beta_decay_steps=0)),
    ],
)
def test_paper_defaults(name, expected):
    s = spec(name=name)
    assert {k: getattr(s, k) for k in expected} == expected


def test_overrides_win_over_defaults():
    s = spec(
        name="dapo",
        eps_high=0.3,
        aggregation="seq_mean_token_mean",
        dynamic_sampling="off",
        overlong_shaping="off",
    )
    assert (s.eps_low, s.eps_high, s.aggregation) == (0.2, 0.3, "seq_mean_token_mean")
    assert not s.dynamic_sampling and s.overlong_buffer == 0
    assert (
        spec(
            name="grpo", dynamic_sampling="on", overlong_buffer=7, overlong_shaping="on"
        ).overlong_buffer
        == 7
    )
    assert spec(name="aipo", is_cap=2.0).is_cap == 2.0


def test_kl_regularizer_defaults():
    s = spec(name="grpo", kl_estimator="k3")
    assert (s.kl_estimator, s.kl_coef) == ("k3", 0.04)  # DeepSeekMath β
    assert spec(name="dapo", kl_estimator="k2", kl_coef=0.1).kl_coef == 0.1
    with pytest.raises(ConfigError, match="kl_coef = 0.0: dapo has no default KL coefficient"):
        spec(name="dapo", kl_estimator="k1")
    with pytest.raises(ConfigError, match="kl_estimator = 'k3': must be 'none': tb already"):
        spec(name="tb", kl_estimator="k3", kl_coef=0.1)


def test_kl_estimator_default_means_the_papers_choice():
    assert AlgorithmConfig().kl_estimator == "default"
    for name in ALGORITHMS:  # only GRPO's paper regularizes with KL in the loss
        s = spec(name=name)
        expected = ("k3", 0.04) if name == "grpo" else ("none", 0.0)
        assert (s.kl_estimator, s.kl_coef) == expected, name
    assert spec(name="grpo", kl_coef=0.1).kl_coef == 0.1  # β overrides, estimator stays k3
    assert spec(name="grpo", kl_estimator="k1").kl_estimator == "k1"
    s = spec(name="grpo", kl_estimator="none")
    assert (s.kl_estimator, s.kl_coef) == ("none", 0.0)
    with pytest.raises(
        ConfigError,
        match="kl_coef = 0.1: dapo's default has no KL regularizer; set kl_estimator to k1, k2 "
        "or k3 to use kl_coef",
    ):
        spec(name="dapo", kl_coef=0.1)
    with pytest.raises(ConfigError, match="kl_estimator = 'none': is 'none' but kl_coef is 0.1"):
        AlgorithmConfig(name="grpo", kl_estimator="none", kl_coef=0.1)


def test_what_the_trainer_must_compute():
    assert spec(name="grpo").needs_reference  # its default k3 KL term
    assert not spec(name="grpo", kl_estimator="none").needs_reference
    assert not spec(name="dapo").needs_reference
    assert spec(name="ppo").required_inputs == ("logp_ref", "values")
    assert spec(name="tb").needs_groups and spec(name="rloo").needs_groups
    assert not spec(name="ppo").needs_groups and not spec(name="reinforce").needs_groups


def test_batch_level_helpers():
    dapo = make_objective(AlgorithmConfig(name="dapo"), max_length=20)  # buffer 20 // 5 = 4
    np.testing.assert_allclose(
        dapo.shape_rewards(np.ones(3), np.array([10, 18, 20])), [1.0, 0.5, 0.0]
    )
    keep, dropped = dapo.filter_groups(np.array([[1.0, 1.0], [0.0, 1.0]]))
    assert keep.tolist() == [False, True] and dropped == 1
    grpo = make_objective(AlgorithmConfig(name="grpo"), max_length=20)
    np.testing.assert_array_equal(grpo.shape_rewards(np.ones(2), np.array([20, 20])), [1.0, 1.0])
    assert grpo.filter_groups(np.ones((3, 2)))[1] == 0
    tb = make_objective(AlgorithmConfig(name="tb"), max_length=20)
    assert tb.beta(250) == pytest.approx(0.008)


def test_bad_lengths():
    with pytest.raises(ConfigError, match="max_length = 0: must be >= 1"):
        spec(max_length=0)
    with pytest.raises(ConfigError, match=r"overlong_buffer = 50: must be <= max_length \(20\)"):
        spec(name="dapo", overlong_buffer=50, max_length=20)


def test_objective_is_hashable_for_jit():
    a = make_objective(AlgorithmConfig(name="gspo"), max_length=8)
    b = make_objective(AlgorithmConfig(name="gspo"), max_length=8)
    assert a == b and hash(a) == hash(b)
