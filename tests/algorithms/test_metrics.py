"""The metrics every objective returns, on a batch small enough to compute them by hand."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.algorithms import RolloutBatch, make_objective
from rlax_tpu.config import AlgorithmConfig

RATIO = np.array([[1.5, 1.1, 0.5], [0.5, 1.5, 0.9]])  # π_θ/π_old per token
LOGP_OLD = np.log([[0.3, 0.2, 0.4], [0.3, 0.2, 0.4]])
LOGP = LOGP_OLD + np.log(RATIO)
A_POS = 0.5 / (np.sqrt(0.5) + 1e-6)  # group-normalized advantage of rewards (1, 0)


def _metrics(name, **batch_fields):
    batch = RolloutBatch(
        logp_old=LOGP_OLD,
        logp_behaviour=LOGP_OLD - np.log([[1.0, 2.0, 1.0], [1.0, 1.0, 1.0]]),  # π_old/μ = 2 once
        mask=np.ones((2, 3)),
        rewards=np.array([1.0, 0.0]),
        logp_ref=LOGP - np.log(2.0),  # π_ref/π_θ = 0.5 everywhere
    )
    batch = dataclasses.replace(batch, **batch_fields)
    obj = make_objective(AlgorithmConfig(name=name, group_size=2), max_length=3)
    entropy = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    return {
        k: float(v)
        for k, v in obj.loss(jnp.asarray(LOGP), obj.prepare(batch), entropy=entropy)[1].items()
    }


def test_eq3_metrics_by_hand():
    m = _metrics("grpo")
    assert m["ratio_mean"] == pytest.approx(1.0)  # (1.5 + 1.1 + 0.5 + 0.5 + 1.5 + 0.9)/6
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["clip_fraction"] == pytest.approx(2 / 6)  # (A>0, ρ=1.5) and (A<0, ρ=0.5)
    # ±A_POS summed in float32: zero up to float32 rounding (2e-8 where XLA orders it otherwise).
    assert m["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert m["advantage_max"] == pytest.approx(A_POS) and m["advantage_min"] == pytest.approx(
        -A_POS
    )
    assert m["advantage_std"] == pytest.approx(A_POS)
    assert m["entropy"] == pytest.approx(3.5)
    assert m["kl_ref"] == pytest.approx(0.5 + np.log(2) - 1)  # k3 with r = 0.5
    assert m["behaviour_logp_diff_mean"] == pytest.approx(np.log(2) / 6)
    assert m["tokens"] == 6.0


def test_every_objective_reports_the_common_metrics():
    common = {
        "ratio_mean",
        "ratio_max",
        "behaviour_logp_diff_mean",
        "behaviour_logp_diff_p95",
        "tokens",
        "kl_ref",
        "entropy",
    }
    eq3 = {
        "clip_fraction",
        "importance_weight_mean",
        "advantage_mean",
        "advantage_std",
        "advantage_min",
        "advantage_max",
        "policy_loss",
    }
    for name in (
        "grpo",
        "dapo",
        "dr_grpo",
        "gspo",
        "cispo",
        "reinforce",
        "rloo",
        "reinforce_pp",
        "aipo",
    ):
        assert common | eq3 <= set(_metrics(name)), name
    assert common | {"tb_log_z_mean", "tb_beta"} <= set(_metrics("tb"))
    assert common | {"dpo_pairs", "dpo_margin_mean", "dpo_accuracy"} <= set(_metrics("online_dpo"))


def test_aipo_and_cispo_clip_fraction():
    # AIPO: π_θ/μ = ρ·(π_old/μ) = [[1.5, 2.2, 0.5], [0.5, 1.5, 0.9]]; none above the default cap 5.
    assert _metrics("aipo")["clip_fraction"] == 0.0
    # CISPO clips ρ at 1.28 from above only: two tokens with ρ = 1.5.
    assert _metrics("cispo")["clip_fraction"] == pytest.approx(2 / 6)
