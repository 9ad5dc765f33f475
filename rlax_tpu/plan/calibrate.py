"""Costs measured on a run (``--calibrate=RUN_DIR``): what the planner's pieces took there.

From the run's per-step metrics, after ``skip`` warm-up steps (compiles):

* train_s: the mean ``time/train`` (π_old, the update, the publish and push), plus the
  controller's own time between updates (snapshots, ledger, metrics: the mean of each step's
  interval less its ``time/wait`` and ``time/train``), which is as serial as the update;
* verify_s: the mean ``time/verify`` (a step's slowest group, after its generation). Means,
  not medians: a steady state's period is a mean (the warm-up's compiles are skipped). A
  sample's check on one sandbox (the planner's check_s) is that over the rounds the step's
  samples take on the verifier's sandboxes, ⌈B·G / slots⌉ (its samples end generation together
  in a lock-step run);
* reload_s: ``pool/load_s`` over ``pool/loads``, every load of every worker;
* a group's generation: ``pool/generate_s`` over the waves of the workers' calls (below),
  ``slots`` groups at once (the config's decode rows or KV pages, as on a TPU); the rate
  ``pool/groups`` over ``pool/generate_s`` is reported beside it;
* lengths: the mean completion (``rollout/length_mean``) and prompt tokens of a rollout.

A step with a held-out evaluation before it (an evaluation record with ``time/eval`` between it
and the step before) is left out of all of these: its wait holds the evaluation, and the pool's
counts its generation, which the planner models apart.

The run must be in deterministic mode: its jobs hold a worker alone, so the seconds of the
workers' calls add up to their busy time (in throughput mode jobs share a worker's engine and
their calls overlap). And single-turn: an episode's later turns are calls of their own,
counted as groups (``pool/groups``) and overlapping within their hold.

A worker's decode step has the same rows however few groups it holds (``Engine.step_tokens``,
on every backend), so a generation call of k groups (``pool/calls``: a worker's share of a job,
dealt round-robin) takes ``costs.share_time(k)`` mean groups' times: ⌈k / slots⌉ waves, the last
ending with its slowest group (the run's own lengths after the warm-up, ``plan/lengths.py``;
every group the mean when its metrics record none). A group's cost is ``pool/generate_s`` over
the calls' share times. Runs from before ``pool/calls`` count one call a step (one worker).

Workers that share one machine (this host's CPU cores) do not each generate at that rate:
``parallel_workers`` says how many can at once, and with N workers each group takes
max(1, N / parallel_workers) times longer. The verifier's sandboxes run on those cores too
(``PlanCosts.shared_cores``): the planner adds up what an update asks of them. Calibrate such a
layout on a run of one worker: the calls of several that shared a core took their sharing's
time, which the measurement cannot take apart.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

from rlax_tpu.config import RunConfig
from rlax_tpu.observability.metrics import read_metrics
from rlax_tpu.plan.costs import (
    PlanCosts,
    Workload,
    share_time,
    verifier_slots,
    version_bytes,
    worker_slots,
)
from rlax_tpu.plan.lengths import GroupLengths, NoLengths, from_run
from rlax_tpu.plan.simulate import dealt


@dataclasses.dataclass(frozen=True)
class Measured:
    """A deterministic run's pieces (module docstring)."""

    steps: int  # the steps measured (after the warm-up)
    train_s: float  # the update and the controller's own time between updates (overhead_s)
    overhead_s: float
    verify_s: float
    reload_s: float
    groups_per_s: float  # one worker's generation rate
    workload: Workload
    group_s: float  # the mean group's seconds on a worker alone (module docstring)
    lengths: GroupLengths | None = None  # the run's groups after the warm-up (None: none)

    def costs(
        self,
        config: RunConfig,
        *,
        workers: int,
        parallel_workers: float,
        backend: str = "cpu",
    ) -> PlanCosts:
        """The planner's costs with ``workers`` workers, ``parallel_workers`` of which generate
        at the measured rate at once."""
        slots = worker_slots(config, self.workload, backend)
        share = max(1.0, workers / parallel_workers)
        sandboxes = verifier_slots(config)
        rounds = math.ceil(config.rollouts_per_step / sandboxes)
        return PlanCosts(
            train_s=self.train_s,
            group_s=self.group_s * share,
            slots=slots,
            reload_s=self.reload_s,
            check_s=self.verify_s / rounds,
            verifier_slots=sandboxes,
            version_bytes=version_bytes(config),
            shared_cores=parallel_workers if math.isfinite(parallel_workers) else 0.0,
            group_core_s=self.group_s,
            detail={
                "measured_steps": float(self.steps),
                "groups_per_s": self.groups_per_s,
                "worker_share": share,
            },
        )


def measure(run_dir: str | Path, config: RunConfig, *, skip: int = 2) -> Measured:
    """The pieces of the run in ``run_dir`` (made with ``config``'s batch shape). Raises
    ValueError when it has too few steps or was not in deterministic mode."""
    if config.environment.name != "none":
        raise ValueError(
            f"{run_dir}: multi-turn episodes (environment.name {config.environment.name!r}): "
            "each later turn is a generation call of its own, counted as a group and "
            "overlapping the others, so a group's time cannot be taken from the pool's counts; "
            "calibrate on a single-turn run of the same model and layout, and pass "
            "--env_reply_s for the replies"
        )
    # evaluated[i]: an evaluation before record i, or generating during its step
    records, evaluated, pending = [], [], False
    for r in read_metrics(run_dir):
        scalars = r.get("scalars", {})
        pending = pending or "time/eval" in scalars
        if "time/train" in scalars:
            records.append(r)
            # An evaluation beside training shared the workers during this step.
            evaluated.append(pending or scalars.get("pool/eval_calls", 0.0) > 0)
            pending = False
    steps = [r["scalars"] for r in records]
    if not steps:
        raise ValueError(f"{run_dir}: no training steps in its metrics")
    if any("groups/queued" in s for s in steps):
        raise ValueError(
            f"{run_dir} ran in throughput mode: its jobs share a worker's engine, so their "
            "generation seconds overlap; calibrate on a deterministic-mode run"
        )
    if any("pool/groups" not in s for s in steps):
        raise ValueError(f"{run_dir}: its metrics have no pool/ times (a run before the planner)")
    kept = [i for i in range(skip, len(steps)) if not evaluated[i]]
    steady = [steps[i] for i in kept]
    if len(steady) < 2:
        raise ValueError(
            f"{run_dir}: {len(steps)} steps, {len(steady)} after {skip} and without an "
            f"evaluation; calibrating needs at least 2"
        )

    def total(key: str) -> float:
        return sum(s[key] for s in steady)

    if total("pool/groups") <= 0 or total("pool/generate_s") <= 0:
        raise ValueError(f"{run_dir}: no generation measured after step {skip}")
    loads = total("pool/loads")
    rollouts = config.rollouts_per_step
    prompt = statistics.mean(
        (s["trainer/sequence_tokens"] - s["trainer/completion_tokens"]) / rollouts for s in steady
    )
    # What the controller does between updates besides waiting for rollouts and training
    # (snapshots, ledger, metrics): each interval less its wait and its update.
    intervals = [i for i in kept if i >= 1]
    overhead = (
        statistics.fmean(
            max(
                0.0,
                records[i]["wall_time"]
                - records[i - 1]["wall_time"]
                - steps[i]["time/wait"]
                - steps[i]["time/train"],
            )
            for i in intervals
        )
        if intervals
        else 0.0
    )
    workload = Workload(
        prompt=max(1.0, prompt),
        completion=max(1.0, statistics.mean(s["rollout/length_mean"] for s in steady)),
    )
    slots = worker_slots(config, workload, "cpu")
    try:
        lengths: GroupLengths | None = from_run(run_dir, config.algorithm.group_size, skip=skip)
    except NoLengths:
        lengths = None
    seed, units = config.controller.seed, 0.0  # the calls' times in mean groups' times
    for s in steady:
        calls, groups = round(s.get("pool/calls") or 1), round(s["pool/groups"])
        units += sum(share_time(k, slots, lengths, seed) for k in dealt(groups, calls))
    return Measured(
        steps=len(steady),
        train_s=statistics.fmean(s["time/train"] for s in steady) + overhead,
        overhead_s=overhead,
        verify_s=statistics.fmean(s["time/verify"] for s in steady),
        reload_s=total("pool/load_s") / loads if loads else 0.0,
        groups_per_s=total("pool/groups") / total("pool/generate_s"),
        workload=workload,
        group_s=total("pool/generate_s") / units,
        lengths=lengths,
    )


def describe(m: Measured) -> dict[str, Any]:
    """The measured pieces for a plan's assumptions (the lengths are named there apart)."""
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "lengths"}
    return fields | {"workload": dataclasses.asdict(m.workload)}
