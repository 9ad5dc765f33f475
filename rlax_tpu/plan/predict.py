"""A config's predicted schedule: its costs through the simulator of its mode, summarized."""

from __future__ import annotations

import dataclasses
import math

from rlax_tpu.config import RunConfig
from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.controller.throughput import launch_chunk, throughput_queue_cap
from rlax_tpu.plan.costs import PlanCosts, Workload, env_wait_s, share_time, step_verify_s
from rlax_tpu.plan.lengths import GroupLengths
from rlax_tpu.plan.simulate import Costs, dealt, simulate_deterministic
from rlax_tpu.plan.throughput import ThroughputCosts, simulate_throughput

BUSY = 0.9  # a part busier than this is the bottleneck


@dataclasses.dataclass(frozen=True)
class Prediction:
    workers: int
    seconds_per_update: float
    tokens_per_s: float  # completion tokens generated per second
    trainer_busy: float  # fraction of the time the trainer updates
    workers_busy: float  # fraction of the workers' slot-seconds generating
    verifier_busy: float  # fraction of the sandboxes' seconds verifying (0: unbounded)
    staleness: dict[int, int]  # groups consumed at each staleness
    discarded: int  # groups that aged past η_a (all of the simulated updates)
    bottleneck: str
    costs: PlanCosts

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["staleness"] = {str(k): v for k, v in self.staleness.items()}
        return out


def predict(
    config: RunConfig,
    costs: PlanCosts,
    workload: Workload,
    *,
    workers: int,
    steps: int = 100,
    lengths: GroupLengths | None = None,
) -> Prediction:
    """The steady state of ``steps`` simulated updates (the first tenth skipped as warm-up) of
    ``config`` with ``workers`` inference workers, groups' lengths drawn from ``lengths``
    (seeded by controller.seed; None: every sample the mean), held-out evaluations every
    data.eval_every updates at ``costs.eval_s``."""
    if steps < 4:
        raise ValueError("simulate at least 4 updates")
    policy, batch = StalenessPolicy.of(config.controller), config.controller.prompts_per_step
    group = config.algorithm.group_size
    skip, k = max(1, steps // 10), config.data.eval_every
    if k > 0:  # a window of whole evaluation cycles, so that it holds its share of them
        skip = -(-skip // k) * k
        steps = skip + max(1, (steps - 1 - skip) // k) * k + 1
    if config.controller.mode == "throughput":
        cap = (
            throughput_queue_cap(_with_workers(config, workers))
            if math.isinf(policy.acceptance_staleness)
            else math.inf
        )
        schedule = simulate_throughput(
            steps,
            ThroughputCosts(
                group_s=costs.group_s,
                check_s=costs.check_s,
                train_s=costs.train_s,
                reload_s=costs.reload_s,
                samples=group,
                eval_s=costs.eval_s,
                eval_verify_s=costs.eval_verify_s,
                # A group's latency: its turns wait for its launch's replies in lock-step,
                # for its own episodes' one by one.
                env_s=env_wait_s(
                    config,
                    costs.env_reply_s,
                    launch_chunk(batch) * group
                    if config.environment.schedule == "lockstep"
                    else group,
                ),
            ),
            policy,
            batch=batch,
            slots=costs.slots,
            workers=workers,
            queue_cap=cap,
            freshest_first=config.controller.consume_order == "freshest_first",
            verifier_slots=costs.verifier_slots,
            lengths=lengths.drawer(config.controller.seed) if lengths else None,
            eval_every=config.data.eval_every,
            eval_share=config.data.eval_share,
            # Episodes hold their version's epoch (controller/episodes.py): no overlap there.
            overlap=config.inference.overlap_reload
            and not config.inference.continue_on_reload
            and config.environment.name == "none",
        )
        period = schedule.seconds_per_update(skip)
        staleness = schedule.staleness_counts(skip)
        discarded = schedule.discarded
    else:
        # A step's prompts on one worker: waves of fixed-shape steps (``batched``), else P/slots
        # group times (an engine whose steps cost what their rows do).
        if costs.batched:
            # The simulator scales a whole step's time on one worker by ⌈k/slots⌉/⌈P/slots⌉ for
            # a share of k: made exact for the largest share (share_time).
            largest = math.ceil(batch / workers)
            whole = share_time(largest, costs.slots, lengths, config.controller.seed) * (
                math.ceil(batch / costs.slots) / math.ceil(largest / costs.slots)
            )
        else:
            whole = batch / costs.slots
        det = simulate_deterministic(
            steps,
            Costs(
                generate_s=whole * costs.group_s,
                verify_s=step_verify_s(costs, batch * group),
                train_s=costs.train_s,
                reload_s=costs.reload_s,
                eval_s=costs.eval_s,
                eval_verify_s=costs.eval_verify_s,
                env_s=env_wait_s(config, costs.env_reply_s, batch * group),
            ),
            policy,
            workers=workers,
            prompts_per_step=batch,
            slots=costs.slots if costs.batched else 0,
            eval_every=config.data.eval_every,
        )
        period = det.seconds_per_update(skip)
        discarded = 0
        staleness = {}
        for s in det.steps[skip:]:
            staleness[s.staleness] = staleness.get(s.staleness, 0) + batch
        staleness = dict(sorted(staleness.items()))
    cores_busy = 0.0
    if costs.shared_cores > 0:
        # The cores the workers share with the sandboxes are a resource the simulators do not
        # see: an update takes at least what it asks of them (the bottleneck law).
        demand = core_seconds(config, costs, workers, lengths)
        period = max(period, demand.total / costs.shared_cores)
        cores_busy = min(1.0, demand.total / (costs.shared_cores * period))
    trainer_busy = min(1.0, costs.train_s / period)
    if config.controller.mode == "throughput" or not costs.batched:
        # A group holds its slot for its own time (its mean sample's: occupancy).
        generating = batch * costs.group_s / costs.slots
    else:  # a step's waves hold every slot of the worker until its last group is done
        generating = sum(step_waves(config, costs, workers, lengths)) * costs.group_s
    workers_busy = min(1.0, generating / (workers * period))
    # The sandboxes' share: the updates' samples, and an evaluation's every k updates (its
    # verification holds them all for eval_verify_s).
    verifying = batch * group * costs.check_s / costs.verifier_slots if costs.verifier_slots else 0
    verifying_evals = costs.eval_verify_s / k if k > 0 and costs.verifier_slots else 0.0
    verifier_busy = min(1.0, (verifying + verifying_evals) / period)
    # Each worker loads a version every η_r updates, and evaluates every eval_every.
    loading = min(1.0, costs.reload_s / (policy.reload_staleness * period))
    evaluating = min(1.0, costs.eval_s / (k * period)) if k > 0 else 0.0
    busiest = max(
        ("trainer", trainer_busy), ("generation", workers_busy), ("verification", verifier_busy),
        key=lambda part: part[1],
    )  # fmt: skip
    besides = {"weight loads": loading, "evaluations": evaluating}
    if cores_busy >= max(BUSY, busiest[1]):
        parts = dataclasses.asdict(demand)
        bottleneck = "the shared cores: " + ", ".join(
            f"{name} {100 * v / demand.total:.0f}%" for name, v in parts.items() if v > 0
        )
    elif busiest[1] >= BUSY:
        bottleneck = busiest[0]
        if busiest[0] == "verification" and verifying_evals >= 0.005 * period:
            share = verifying_evals / (verifying + verifying_evals)
            bottleneck += f" ({100 * share:.0f}% of it evaluations')"
    elif workers_busy + sum(besides.values()) >= BUSY:
        parts = [f"{name} {100 * v:.0f}%" for name, v in besides.items() if v >= 0.005]
        bottleneck = ", ".join([f"the workers: generation {100 * workers_busy:.0f}%", *parts])
    else:
        idle = 100 * (1 - workers_busy - sum(besides.values()))
        why = "staleness bound, latencies" + (", evaluations' drains" if k > 0 else "")
        bottleneck = f"the schedule: workers idle {idle:.0f}% ({why})"
    return Prediction(
        workers=workers,
        seconds_per_update=period,
        tokens_per_s=config.rollouts_per_step * workload.completion / period,
        trainer_busy=trainer_busy,
        workers_busy=workers_busy,
        verifier_busy=verifier_busy,
        staleness=staleness,
        discarded=discarded,
        bottleneck=bottleneck,
        costs=costs,
    )


@dataclasses.dataclass(frozen=True)
class CoreSeconds:
    """Seconds of the shared cores an update asks for, by what asks."""

    generation: float
    loads: float
    verification: float
    evaluations: float

    @property
    def total(self) -> float:
        return self.generation + self.loads + self.verification + self.evaluations


def step_waves(
    config: RunConfig, costs: PlanCosts, workers: int, lengths: GroupLengths | None
) -> list[float]:
    """Each generating worker's time for its share of a step's B groups (dealt round-robin), in
    mean groups' times (``share_time``)."""
    batch, seed = config.controller.prompts_per_step, config.controller.seed
    return [share_time(k, costs.slots, lengths, seed) for k in dealt(batch, workers) if k]


def core_seconds(
    config: RunConfig, costs: PlanCosts, workers: int, lengths: GroupLengths | None
) -> CoreSeconds:
    """What one update asks of the cores the workers share with the sandboxes: each worker's
    waves of its share of the B groups (``step_waves``: fixed-shape steps cost the same however
    few groups a wave holds, and the last ends with its slowest), its load of a version every
    η_r updates, every sample's check, and an evaluation's generation and checks every
    eval_every updates. An estimate in throughput mode, whose workers refill slots as groups end
    rather than in waves."""
    waves = step_waves(config, costs, workers, lengths)
    policy = StalenessPolicy.of(config.controller)
    k = config.data.eval_every
    # Every worker generates its part of an evaluation at once, for eval_s, at the sharing's
    # pace; more sandboxes than cores check slower than alone (check_s measured so). The
    # calibration counts at least one sandbox (verifier_slots 0 is the rooflines' unbounded).
    unshared = costs.group_core_s / costs.group_s if costs.group_s else 1.0
    sandboxes = max(1, costs.verifier_slots)
    checking = min(sandboxes, costs.shared_cores)  # cores the checks use
    evaluation = workers * costs.eval_s * unshared + costs.eval_verify_s * checking
    return CoreSeconds(
        generation=sum(waves) * costs.group_core_s,
        loads=len(waves) * costs.reload_s / policy.reload_staleness,
        verification=config.rollouts_per_step * costs.check_s * checking / sandboxes,
        evaluations=evaluation / k if k > 0 else 0.0,
    )


def _with_workers(config: RunConfig, workers: int) -> RunConfig:
    return dataclasses.replace(
        config, inference=dataclasses.replace(config.inference, num_workers=workers)
    )
