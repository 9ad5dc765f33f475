"""Workers and sandboxes that share cores (the CPU stand-in): what an update asks of them, and
the period it bounds."""

from __future__ import annotations

import dataclasses

import pytest

from rlax_tpu.plan.costs import PlanCosts, Workload
from rlax_tpu.plan.lengths import GroupLengths
from rlax_tpu.plan.predict import core_seconds, predict
from tests.config.test_validation import build


def _costs(**kw: float) -> PlanCosts:
    base = dict(  # noqa: C408
        train_s=1.0,
        group_s=3.0,  # three workers on one core: a wave alone takes 1 s
        slots=2,
        reload_s=0.5,
        check_s=0.1,
        verifier_slots=4,
        version_bytes=0,
        detail={},
        shared_cores=2.0,
        group_core_s=1.0,
        eval_s=6.0,
        eval_verify_s=0.4,
    )
    return PlanCosts(**(base | kw))


def test_core_seconds_by_hand():
    """5 prompts of 2 samples over 3 workers of 2 slots, every 2 updates an evaluation:
    * generation: shares 2, 2, 1, a wave each (a wave of one group costs a whole one): 3 x 1 s;
    * loads: each worker every update (η_r = 1): 3 x 0.5 s;
    * verification: 10 samples; 4 sandboxes on 2 cores check at half speed, so a check of
      0.1 s holds half a core: 10 x 0.05 s;
    * an evaluation: 3 workers for 6 s at a third of a core each, and its 0.4 s of checks on
      both cores: (6 + 0.8) / 2 s an update."""
    config = build(
        {
            "controller.prompts_per_step": 5,
            "algorithm.group_size": 2,
            "data.eval_every": 2,
            "trainer.micro_batch_size": 5,
        }
    )
    got = core_seconds(config, _costs(), workers=3, lengths=None)
    assert (got.generation, got.loads, got.verification, got.evaluations) == pytest.approx(
        (3.0, 1.5, 0.5, 3.4)
    )
    # A wave ends with its slowest group. Samples of 1, 1, 1 and 3 tokens (mean 1.5) make
    # groups of latency 2/3 and 2 (their longest over the mean), equally likely: a wave of one
    # ends at 4/3 in expectation, of two at 2/3 / 4 + 2 * 3/4 = 5/3.
    lengths = GroupLengths(((1.0, 1.0), (1.0, 3.0)), "two groups")
    waves = core_seconds(config, _costs(), workers=3, lengths=lengths).generation
    assert waves == pytest.approx(2 * 5 / 3 + 4 / 3, abs=0.15)  # 256 seeded draws a wave


def test_shared_cores_bound_the_period_and_are_named():
    """One-step off-policy, one worker: a wave of the 8 groups in 1 s, their 64 samples on one
    sandbox in 2 s, an update 1 s. Apart, verification hides generation: 2 s an update. On one
    core the two add up: 3 s, and the label says what took the core."""
    config = build({"data.eval_every": 0})
    costs = _costs(
        group_s=1.0,
        group_core_s=1.0,
        slots=8,
        reload_s=0.0,
        check_s=2 / 64,
        verifier_slots=1,
        shared_cores=1.0,
    )
    workload = Workload(prompt=10, completion=10)
    apart = predict(config, dataclasses.replace(costs, shared_cores=0.0), workload, workers=1)
    shared = predict(config, costs, workload, workers=1)
    assert apart.seconds_per_update == pytest.approx(2.0)
    assert apart.bottleneck == "verification"
    assert shared.seconds_per_update == pytest.approx(3.0)
    assert shared.bottleneck == "the shared cores: generation 33%, verification 67%"
