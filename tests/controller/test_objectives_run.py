"""The objectives added beside TRL's (SAPO, LUSPO, VESPO), the loss options (batch reward
scaling, two-sided delta, bias-corrected KL) and IcePop's two-sided band on the length-normalized
sequence ratio train from a config through the controller with the real local components, and the
run logs each update's objective value beside the loss."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller.app import build_prompter
from rlax_tpu.types import VerdictKind
from tests.controller.test_dynamic_sampling import Batches, HashedVerdicts
from tests.controller.test_scheduling import make_config, run_controller

RUNS = [
    dict(name="sapo", reward_scaling="batch"),
    dict(name="luspo", delta=2.0),
    dict(name="vespo", kl_estimator="k3", kl_coef=0.01, kl_bias_correction=True),
    dict(name="dapo", behaviour_correction="seq_mask", behaviour_floor=0.5, behaviour_cap=2.0),
]


@pytest.mark.parametrize("algorithm", RUNS, ids=[r["name"] for r in RUNS])
def test_the_objective_trains_through_the_controller(tmp_path, algorithm):
    d = to_dict(make_config(tmp_path, num_steps=2, prompts_per_step=2))
    d["algorithm"] |= algorithm
    cfg = from_dict(RunConfig, d)

    def wrap(comps):  # rewards that differ within groups, so advantages are not all zero
        comps.verifier = HashedVerdicts(comps.verifier)

    ctl = run_controller(cfg, wrap)
    assert ctl.version == 2 and ctl.objective.spec.name == algorithm["name"]
    updates = [
        json.loads(line)["scalars"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [u for u in updates if "trainer/objective" in u]
    assert len(logged) == 2
    for u in logged:
        assert math.isfinite(u["trainer/objective"]) and math.isfinite(u["trainer/loss"])
    assert any(u["trainer/grad_norm"] > 0 for u in logged)
    if "kl_coef" in algorithm:
        assert all(math.isfinite(u["trainer/kl_loss"]) for u in logged)
    if "behaviour_floor" in algorithm:  # the band is applied: its weights are logged
        assert all(0 < u["trainer/behaviour_weight_mean"] <= 2.0 for u in logged)


def test_a_reward_function_of_the_users_own_scores_every_rollout(tmp_path):
    """algorithm.reward names a function a plugin registered (tests/algorithms/plugin_reward.py):
    it sees each rollout's verdict, decoded text, tokens and problem, and its values are the
    rewards the trainer gets."""
    from tests.algorithms import plugin_reward

    d = to_dict(make_config(tmp_path, num_steps=1, prompts_per_step=2))
    d["algorithm"] |= dict(reward="brevity", plugins=("tests.algorithms.plugin_reward",))
    cfg = from_dict(RunConfig, d)
    plugin_reward.SEEN.clear()
    held = {}

    def wrap(comps):
        comps.verifier = HashedVerdicts(comps.verifier)
        comps.trainer = held["trainer"] = Batches(comps.trainer)

    ctl = run_controller(cfg, wrap)
    assert ctl.version == 1
    seen = plugin_reward.SEEN
    assert len(seen) == 2 * cfg.algorithm.group_size  # one call per rollout
    tokenizer = build_prompter(cfg, tmp_path).tokenizer
    for x in seen:
        assert x.completion == tokenizer.decode(list(x.tokens))
        assert x.problem.id and x.verdict.kind in (VerdictKind.ACCEPTED, VerdictKind.WRONG_ANSWER)
    [batch] = held["trainer"].batches
    expected = sorted(float(x.verdict.accepted) - 0.01 * len(x.tokens) for x in seen)
    np.testing.assert_allclose(sorted(batch.rewards), expected, rtol=1e-6)
    # Rewards follow the lengths the trainer was given, row by row.
    accepted = np.asarray(batch.rewards) > 0.5
    np.testing.assert_allclose(batch.rewards, accepted - 0.01 * batch.completion_lengths, rtol=1e-6)
