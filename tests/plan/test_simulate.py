"""The deterministic schedule's simulator against schedules worked out by hand."""

from __future__ import annotations

import math

import pytest

from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.plan import Costs, simulate_deterministic


def _policy(d: int, eta_r: int = 1, eta_a: float = math.inf) -> StalenessPolicy:
    return StalenessPolicy(reload_staleness=eta_r, acceptance_staleness=eta_a, pipeline_depth=d)


COSTS = Costs(generate_s=10.0, verify_s=1.0, train_s=4.0)


def test_on_policy_runs_generation_verification_and_update_in_series():
    """d = 0: step s is generated with version s, so nothing overlaps: 10 + 1 + 4 = 15 s."""
    sched = simulate_deterministic(4, COSTS, _policy(0))
    assert [
        (s.launched, s.generated, s.verified, s.train_start, s.train_end) for s in sched.steps
    ] == [
        (0, 10, 11, 11, 15),
        (15, 25, 26, 26, 30),
        (30, 40, 41, 41, 45),
        (45, 55, 56, 56, 60),
    ]
    assert sched.seconds_per_update() == 15 and [s.staleness for s in sched.steps] == [0] * 4
    # After step 0: updates of 4 s in [26, 60], the trainer waiting 11 s before each.
    assert sched.trainer_idle_fraction() == pytest.approx(1 - 3 * 4 / (60 - 26))


def test_one_step_off_policy_overlaps_generation_with_the_update():
    """d = 1, one worker. Step 0 launches jobs 0 and 1 (both version 0): the worker runs them
    back to back, [0, 10] and [10, 20]. Update 0 runs [11, 15]; step 1 launches job 2 at 15, which
    starts when the worker is free at 20: [20, 30]. Update 1 needs job 1 verified at 21: [21, 25].
    From then on the worker is the bottleneck: one update per 10 s, the trainer idle 6 of them."""
    sched = simulate_deterministic(5, COSTS, _policy(1))
    got = [(s.launched, s.generated, s.train_start, s.train_end) for s in sched.steps]
    assert got == [(0, 10, 11, 15), (0, 20, 21, 25), (15, 30, 31, 35), (25, 40, 41, 45),
                   (35, 50, 51, 55)]  # fmt: skip
    assert sched.seconds_per_update() == 10
    assert sched.trainer_idle_fraction(skip=1) == pytest.approx(1 - 4 * 4 / (55 - 21))
    assert [s.staleness for s in sched.steps] == [0, 1, 1, 1, 1]
    assert [s.wait_s for s in sched.steps] == [11, 6, 6, 6, 6]


def test_a_fast_worker_leaves_the_trainer_as_the_bottleneck():
    """Generation 2 s, update 4 s, d = 1: step s + 1's rollouts are ready while update s runs,
    so updates follow each other with no gap after the first: 4 s per update."""
    sched = simulate_deterministic(6, Costs(generate_s=2, verify_s=0.5, train_s=4), _policy(1))
    assert sched.seconds_per_update() == 4 and sched.trainer_idle_fraction() == 0
    assert [s.wait_s for s in sched.steps[1:]] == [0.0] * 5


def test_reload_staleness_bounds_and_the_reloads_cost():
    """η_r = 2, d = 1: g = 0, 0, 0, 2, 2, 4 and staleness 0, 1, 2, 1, 2, 1 (at most d + η_r - 1);
    a worker pays the reload only when the version changes (jobs 3 and 5)."""
    policy = _policy(1, eta_r=2)
    sched = simulate_deterministic(6, Costs(generate_s=10, train_s=4, reload_s=3), policy)
    assert [s.version for s in sched.steps] == [0, 0, 0, 2, 2, 4]
    assert [s.staleness for s in sched.steps] == [0, 1, 2, 1, 2, 1]
    assert max(s.staleness for s in sched.steps) == policy.max_deterministic_staleness()
    # Job 0 pays the first load (3 s); jobs 1 and 2 reuse version 0; job 3 loads version 2
    # (launched at 27 when update 1 ends, it waits for the worker until 33, loads, generates).
    assert [s.generated for s in sched.steps[:4]] == [13, 23, 33, 46]


def test_workers_split_a_steps_prompts_round_robin():
    """4 prompts over 3 workers: shares of 2, 1 and 1 prompts; a job ends with its largest
    share (10 s x 2/4 = 5 s)."""
    sched = simulate_deterministic(3, COSTS, _policy(0), workers=3, prompts_per_step=4)
    assert [s.generated - s.launched for s in sched.steps] == [5.0, 5.0, 5.0]
    assert sched.seconds_per_update() == 5 + 1 + 4


def test_bad_costs_are_refused():
    with pytest.raises(ValueError, match="generate_s must be a finite number >= 0"):
        Costs(generate_s=-1, train_s=1)
    with pytest.raises(ValueError, match="train_s"):
        Costs(generate_s=1, train_s=float("nan"))
    with pytest.raises(ValueError, match=">= 1"):
        simulate_deterministic(0, COSTS, _policy(0))


def test_an_evaluation_queues_on_the_workers_and_the_controller_goes_on():
    """eval_every = 2, d = 1: step 0 begins with a 5 s evaluation queued on the worker; jobs 0
    and 1, launched at 0 behind it, run [5, 15] and [15, 25]. Step 2 begins at 30: its
    evaluation queues behind job 2 ([25, 35]) and runs [35, 40], while update 2 goes ahead as
    soon as job 2 is verified (36): [36, 40], where the controller that waited for it
    trained at [40, 44]."""
    costs = Costs(generate_s=10, verify_s=1, train_s=4, eval_s=5)
    sched = simulate_deterministic(3, costs, _policy(1), eval_every=2)
    got = [(s.launched, s.generated, s.train_start, s.train_end) for s in sched.steps]
    assert got == [(0, 15, 16, 20), (0, 25, 26, 30), (20, 35, 36, 40)]


def test_an_evaluation_is_graded_before_the_steps_generated_after_it():
    """The sandboxes take an evaluation's checks (6 s) once it is generated, before a step
    generated later: step 1's job ([15, 25], behind the evaluation [0, 5] and job 0) is
    verified after them."""
    costs = Costs(generate_s=10, verify_s=1, train_s=4, eval_s=5, eval_verify_s=6)
    sched = simulate_deterministic(2, costs, _policy(1), eval_every=2)
    # Evaluation generated at 5, graded [5, 11]; job 0 [5, 15] verified [15, 16].
    assert [s.train_start for s in sched.steps] == [16, 26]


def test_on_an_accelerator_a_small_share_costs_a_whole_wave():
    """4 prompts over 4 workers of 2 slots, 10 s for all 4 on one worker (2 waves of 5 s): a
    share of 1 prompt takes a wave, 5 s, not a quarter of 10 (a step costs the same for fewer
    rows). On-policy: 5 + 1 + 4 = 10 s an update."""
    sched = simulate_deterministic(3, COSTS, _policy(0), workers=4, prompts_per_step=4, slots=2)
    assert [s.generated - s.launched for s in sched.steps] == [5, 5, 5]
    assert sched.seconds_per_update() == 10
    linear = simulate_deterministic(3, COSTS, _policy(0), workers=4, prompts_per_step=4)
    assert [s.generated - s.launched for s in linear.steps] == [2.5, 2.5, 2.5]


def test_the_verifiers_take_one_steps_rollouts_at_a_time():
    """d = 1, generation 1 s, verification 4 s, updates 1 s. Jobs 0 and 1 are generated at 1
    and 2; job 0 is verified [1, 5], job 1 must wait for the verifiers: [5, 9]. Update 0 runs
    [5, 6], update 1 [9, 10]: one update per 4 s of verification (overlapping them would have
    given 2 s)."""
    costs = Costs(generate_s=1.0, verify_s=4.0, train_s=1.0)
    sched = simulate_deterministic(5, costs, _policy(1))
    assert [s.verified for s in sched.steps[:2]] == [5, 9]
    assert [s.train_end for s in sched.steps[:2]] == [6, 10]
    assert sched.seconds_per_update() == 4


def test_episodes_hold_a_steps_workers_while_the_environment_replies():
    """d = 0, env_s = 3: each job ends 3 s after its turns (its hold keeps the worker): 10 + 3
    + 1 + 4 = 18 s an update."""
    sched = simulate_deterministic(
        3, Costs(generate_s=10.0, verify_s=1.0, train_s=4.0, env_s=3.0), _policy(0)
    )
    assert [(s.generated, s.verified, s.train_end) for s in sched.steps] == [
        (13, 14, 18),
        (31, 32, 36),
        (49, 50, 54),
    ]
    assert sched.seconds_per_update() == 18
