"""The objectives added beside TRL's (SAPO, LUSPO, VESPO), the loss options (batch reward
scaling, two-sided delta, bias-corrected KL) and IcePop's two-sided band on the length-normalized
sequence ratio train from a config through the controller with the real local components, and the
run logs each update's objective value beside the loss."""

from __future__ import annotations

import json
import math

import pytest

from rlax_tpu.config import RunConfig, from_dict, to_dict
from tests.controller.test_dynamic_sampling import HashedVerdicts
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
    updates = [json.loads(line)["scalars"] for line in
               (tmp_path / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    logged = [u for u in updates if "trainer/objective" in u]
    assert len(logged) == 2
    for u in logged:
        assert math.isfinite(u["trainer/objective"]) and math.isfinite(u["trainer/loss"])
    assert any(u["trainer/grad_norm"] > 0 for u in logged)
    if "kl_coef" in algorithm:
        assert all(math.isfinite(u["trainer/kl_loss"]) for u in logged)
    if "behaviour_floor" in algorithm:  # the band is applied: its weights are logged
        assert all(0 < u["trainer/behaviour_weight_mean"] <= 2.0 for u in logged)
