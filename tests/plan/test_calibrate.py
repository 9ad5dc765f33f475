"""Costs measured on a run's metrics, and plans made from them."""

from __future__ import annotations

import pytest

from rlax_tpu.observability.metrics import MetricsWriter
from rlax_tpu.plan.calibrate import measure
from rlax_tpu.plan.command import PlanError, plan
from tests.config.test_validation import build


def _step(i: int, **extra: float) -> dict[str, float]:
    """Step i of a made-up deterministic run of the local preset (64 rollouts a step)."""
    return {
        "time/train": 2.0 + (i % 3),  # 2, 3, 4, 2, 3, 4, ...
        "time/verify": 0.5,
        "time/wait": 5.0,
        "pool/load_s": 0.3,
        "pool/loads": 1.0,
        "pool/generate_s": 4.0,
        "pool/groups": 8.0,
        "rollout/length_mean": 30.0 + i,
        "trainer/sequence_tokens": 64 * 100.0 + 64 * 30,
        "trainer/completion_tokens": 64 * 30.0,
    } | extra


def _run(tmp_path, steps: int = 7, evaluated: tuple[int, ...] = (), lengths=None, **extra: float):  # noqa: ANN001, ANN003, ANN202
    """An update every 10 s; before the steps of index ``evaluated``, a 3 s held-out evaluation
    as the controller runs it: inside the step's wait, its generation in the pool's counts.
    ``lengths``: step i's trained completion lengths (the lengths/trained histogram), a list
    for every step or a function of i."""
    writer = MetricsWriter(tmp_path)
    late = 0.0
    for i in range(steps):
        step = _step(i, **extra)
        if i in evaluated:
            writer.write(i + 1, {"eval/pass@1": 0.5, "time/eval": 3.0})
            late += 3.0
            step["time/wait"] += 3.0
            step["pool/generate_s"] += 2.0
            step["pool/groups"] += 48.0
        trained = lengths(i) if callable(lengths) else lengths
        hist = {"lengths/trained": trained} if trained else None
        writer.write(i + 1, step, hist, wall_time=10.0 * i + late)
        writer.write(i + 1, {"eval/pass@1": 0.5})  # a record of no step, without a time
    writer.close()
    return tmp_path


def test_the_pieces_are_the_runs_steps_after_the_warm_up(tmp_path):
    m = measure(_run(tmp_path), build({}), skip=2)
    # Steps 3..7: train 4, 2, 3, 4, 2 -> median 3; each 10 s interval less its 5 s wait and its
    # train leaves 1, 3, 2, 1, 3 s of the controller's own -> median 2, counted with the
    # update; 40 groups in 20 s of generation calls.
    assert (m.steps, m.overhead_s, m.train_s, m.verify_s, m.reload_s) == (5, 2.0, 5.0, 0.5, 0.3)
    assert m.groups_per_s == 2.0
    assert m.workload.prompt == 100 and m.workload.completion == 34  # mean of 32..36
    c = m.costs(build({}), workers=3, parallel_workers=1)
    # The local preset's 64 rows hold 8 groups of 8: a group holds its slot 8 / 2 s, three
    # times longer when three workers share one worker's speed.
    assert (c.slots, c.group_s) == (8, 12.0)
    assert m.costs(build({}), workers=3, parallel_workers=float("inf")).group_s == 4.0


def test_steps_with_an_evaluation_are_left_out(tmp_path):
    # Steps 2..6 without 3 and 5 (evaluated): trains 4, 3, 2 s and 1, 2, 3 s of the
    # controller's own; 8 groups in 4 s each, the evaluations' groups not counted.
    m = measure(_run(tmp_path, evaluated=(3, 5)), build({}), skip=2)
    assert (m.steps, m.overhead_s, m.train_s, m.groups_per_s) == (3, 2.0, 5.0, 2.0)


def test_runs_that_cannot_be_measured_are_refused(tmp_path):
    with pytest.raises(ValueError, match="throughput mode"):
        measure(_run(tmp_path / "a", **{"groups/queued": 3.0}), build({}))
    with pytest.raises(ValueError, match="calibrating needs at least 2"):
        measure(_run(tmp_path / "b", steps=3), build({}))
    with pytest.raises(ValueError, match="no training steps"):
        measure(tmp_path / "missing", build({}))
    episodes = build({"environment.name": "code_repair", "data.prompt_style": "chat"})
    with pytest.raises(ValueError, match="multi-turn episodes .* calibrate on a single-turn run"):
        measure(_run(tmp_path / "c"), episodes)


def test_a_calibrated_plan_of_one_worker_predicts_the_measured_step(tmp_path):
    """Lock-step on-policy (d = 0): an update every load + generation + verify + train, the
    identity the calibration must keep on the run it came from (no evaluations between)."""
    config = build(
        {
            "controller.pipeline_depth": 0,
            "controller.acceptance_staleness": 0,
            "data.eval_every": 0,
        }
    )
    _, out = plan(
        config,
        trainer_topology="",
        inference_topology="",
        calibrate=str(_run(tmp_path)),
        workers=["1", "2"],
        parallel_workers=1,
        steps=20,
    )
    one, two = out["predictions"]
    # 8 groups at 2 groups/s = 4 s, a load 0.3 s, verify 0.5 s, train 3 s and 2 s of the
    # controller's own.
    assert one["seconds_per_update"] == pytest.approx(9.8)
    # Two workers sharing one's core: each runs its 4 groups as a wave of the engine's
    # fixed-shape steps, which costs a whole wave's 4 s alone and 8 s at half the core. Slower.
    assert two["seconds_per_update"] == pytest.approx(13.8)
    assert one["bottleneck"].startswith("the schedule") and "cores" not in two["bottleneck"]
    assert out["assumptions"]["calibrated_on"] == str(tmp_path)
    with pytest.raises(PlanError, match="do not apply"):
        plan(config, trainer_topology="", inference_topology="", calibrate="x", lengths=["9", "9"])


def test_a_run_with_its_layouts_reports_gives_the_efficiency_it_reached(tmp_path):
    """--calibrate with --aot: the run's measured pieces against its own layout's rooflines.
    The made-up run trains in 3 s (median; 5 s with the controller's own 2 s between updates,
    which counts as the update's) and makes 2 groups a second on a worker; the
    rooflines of tests/plan/test_costs.py at efficiency 1 (100-token prompts and 34-token
    completions, the run's means): an update of (0.1 + 4·(134/304)·1.5 + 0.25) s, a group of
    8 prefills of 1.5625·0.04 s and 34 decode steps of 0.01 s, 8 at once."""
    from tests.plan.test_command import _reports

    _, out = plan(
        build({}),
        trainer_topology="v5e:2x2",
        inference_topology="v5e:2x2",
        calibrate=str(_run(tmp_path / "run")),
        aot=[_reports(tmp_path)],
        server_gbps=8000.0,  # a push of 3.4 ms: nearly all of the 3 s is the update
        steps=12,
    )
    eff = out["assumptions"]["measured_efficiency"]
    update = 0.1 + 4 * (134 / 304) * 1.5 + 0.25
    assert eff["train"] == pytest.approx(update / (5.0 - 3_412_480 / 1e12), rel=1e-9)
    group = 8 * 1.5625 * 0.04 + 34 * 0.01
    assert eff["generate"] == pytest.approx(group * 2.0 / 8, rel=1e-9)


LOCK_STEP = {
    "controller.pipeline_depth": 0,
    "controller.acceptance_staleness": 0,
    "data.eval_every": 0,
}


@pytest.mark.parametrize(
    ("overrides", "pool", "workers", "want"),
    [
        # 4 groups on 8 slots: a wave of fixed-shape steps all the same (4 s, as 8 would take).
        ({"controller.prompts_per_step": 4}, {"pool/groups": 4.0}, 1, 9.8),
        # 12 groups on 8 slots: 2 waves of 2 s.
        (
            {"controller.prompts_per_step": 12, "trainer.micro_batch_size": 32},
            {"pool/groups": 12.0},
            1,
            9.8,
        ),
        # 12 groups of spread lengths (each done at 2.4 mean groups' times): a full wave at the
        # mean and the last ending with its slowest, 1 + 2.4 mean groups in the 4 s.
        (
            {"controller.prompts_per_step": 12, "trainer.micro_batch_size": 32},
            {"pool/groups": 12.0, "lengths": ([10.0] * 7 + [30.0]) * 12},
            1,
            9.8,
        ),
        # Two workers, a call of 4 groups each (one wave of 2 s): 2 s, not 4.
        ({"inference.num_workers": 2}, {"pool/calls": 2.0}, 2, 7.8),
    ],
)
def test_a_lock_step_plan_predicts_the_run_it_was_calibrated_on(
    tmp_path, overrides, pool, workers, want
):
    """A worker's share of a job is ⌈k / slots⌉ waves whatever k is: the calibration counts a
    run's waves from its calls (pool/calls; one a step before the count), and the plan of the
    run's own layout gives its generation back (4 s of calls a step, a load 0.3 s, verify 0.5
    s, train 3 s and 2 s of the controller's own)."""
    config = build(LOCK_STEP | overrides)
    _, out = plan(
        config,
        trainer_topology="",
        inference_topology="",
        calibrate=str(_run(tmp_path, **pool)),
        workers=[str(workers)],
        steps=20,
    )
    assert out["predictions"][0]["seconds_per_update"] == pytest.approx(want)


def test_a_wave_ends_with_its_slowest_group_and_the_costs_are_the_mean_groups(tmp_path):
    """Every group of the run after its 2 warm-up steps: seven samples of 10 tokens and one of
    30 (mean 12.5), so each is done 30 / 12.5 = 2.4 mean samples' time after it starts. The 4 s
    of a wave of 8 groups is 2.4 times the mean group's; the plan puts the 2.4 back for a wave
    from the same groups (not the warm-up's, all 10 tokens), and the calibration keeps its
    identity on its own run."""
    spread = ([10.0] * 7 + [30.0]) * 8
    run = _run(tmp_path, lengths=lambda i: [10.0] * 64 if i < 2 else spread)
    config = build(LOCK_STEP)
    m = measure(run, config, skip=2)
    assert m.group_s == pytest.approx(4 / 2.4)
    c = m.costs(config, workers=1, parallel_workers=1)
    assert (c.group_s, c.group_core_s, c.shared_cores) == pytest.approx((4 / 2.4, 4 / 2.4, 1))
    _, out = plan(config, trainer_topology="", inference_topology="", calibrate=str(run), steps=20)
    assert out["predictions"][0]["seconds_per_update"] == pytest.approx(9.8)
