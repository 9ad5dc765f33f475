"""A discrete-event model of the controller's deterministic schedule (issue [planner]).

What it models, as ``controller/loop.py``'s ``run_deterministic`` and ``controller/pool.py`` do:

* Step s begins when update s - 1 has finished (and published version s). It launches the jobs
  of steps s..s+d (d = ``pipeline_depth``) not launched yet; step t generates with version
  g(t) = η_r·⌊max(0, t − d)/η_r⌋ (``StalenessPolicy.generation_version``), which exists by then.
* A job's prompts are split round-robin over the N workers; each worker runs its shares one job
  at a time in launch order (``exclusive_jobs``), loading the job's version first when it holds
  another (``reload_s``). A job is generated when every share is; its verification follows
  (``verify_s``, the verifiers beside the workers), one job's after another's: when steps
  overlap, the verifiers' sandboxes bound them, not a job's latency.
* Update s starts when step s's job is verified and update s - 1 is done; it takes π_old +
  update + publish (``train_s``), then step s + 1 begins.
* Multi-turn episodes: a step's job also waits ``env_s`` on environment replies once its turns
  are generated (``costs.env_wait_s``), its workers held meanwhile (the job's hold).
* With ``eval_every`` = k > 0, step s begins with a held-out evaluation of version s when s is
  a multiple of k (the controller's ``_eval_due``). It runs beside training
  (controller/evaluation.py): queued on every worker after the shares launched before it
  (a load of version s where the worker holds another; ``eval_s``), graded on the verifiers'
  sandboxes (``eval_verify_s``) before the steps generated after it, and the controller launches
  and trains meanwhile.

Costs are seconds per step at this topology (a worker generating a whole step's prompts takes
``generate_s``; a share of k of P prompts takes generate_s·k/P). Throughput mode is
``plan/throughput.py``.
"""

from __future__ import annotations

import dataclasses
import math

from rlax_tpu.controller.staleness import StalenessPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds of one step's pieces (see the module docstring)."""

    generate_s: float  # every prompt of a step on one worker
    verify_s: float = 0.0
    train_s: float  # π_old, the update and the publish
    reload_s: float = 0.0  # a worker loading another version (pull + device put)
    eval_s: float = 0.0  # one held-out evaluation's generation on the workers
    eval_verify_s: float = 0.0  # and its grading after it
    env_s: float = 0.0  # a step's job waiting on environment replies (episodes; env_wait_s)

    def __post_init__(self) -> None:
        names = ("generate_s", "verify_s", "train_s", "reload_s", "eval_s", "eval_verify_s")
        for name in (*names, "env_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Costs.{name} must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """When step ``step``'s pieces happened (seconds from the start)."""

    step: int
    version: int  # g(step): the weights it was generated with
    launched: float
    generated: float  # its last share done
    verified: float
    train_start: float
    train_end: float
    wait_s: float  # the trainer idle between step begin and this update (waiting for rollouts)

    @property
    def staleness(self) -> int:
        """Of its rollouts when consumed by update ``step`` (from version ``step``)."""
        return self.step - self.version


def mean_interval(ends: list[float], skip: int) -> float:
    """Mean seconds between consecutive update ends, after the first ``skip``."""
    ends = ends[skip:]
    if len(ends) < 2:
        raise ValueError(f"need at least {skip + 2} updates for a steady-state rate")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: list[StepTimes]

    def seconds_per_update(self, skip: int = 1) -> float:
        """Mean seconds between consecutive update ends, after ``skip`` warm-up steps."""
        return mean_interval([s.train_end for s in self.steps], skip)

    def trainer_idle_fraction(self, skip: int = 1) -> float:
        """The fraction of the time after ``skip`` steps in which no update ran."""
        steps = self.steps[skip:]
        span = steps[-1].train_end - steps[0].train_start
        busy = sum(s.train_end - s.train_start for s in steps)
        return 1.0 - busy / span if span > 0 else 0.0


def dealt(groups: int, workers: int) -> list[int]:
    """Groups each worker gets when ``groups`` are dealt round-robin over ``workers`` (as
    WorkerPool.submit deals a job's)."""
    return [len(range(w, groups, workers)) for w in range(workers)]


def _fraction(k: int, prompts: int, slots: int) -> float:
    """The part of a whole step's generation time a share of k of ``prompts`` takes."""
    if slots <= 0:
        return k / prompts
    return math.ceil(k / slots) / math.ceil(prompts / slots)


def simulate_deterministic(
    steps: int,
    costs: Costs,
    policy: StalenessPolicy,
    *,
    workers: int = 1,
    prompts_per_step: int = 1,
    eval_every: int = 0,
    slots: int = 0,
) -> Schedule:
    """The schedule of ``steps`` updates (module docstring). ``slots`` > 0: a worker generates
    that many prompts at once in the time of one (continuous batching on an accelerator, whose
    step costs the same for fewer rows), so a share of k prompts takes
    generate_s·⌈k/slots⌉/⌈P/slots⌉; 0: k/P of generate_s."""
    if steps < 1 or workers < 1 or prompts_per_step < 1:
        raise ValueError("steps, workers and prompts_per_step must be >= 1")
    d = policy.pipeline_depth
    # Prompts of a step per worker, as WorkerPool.submit's round-robin deals them.
    shares = dealt(prompts_per_step, workers)
    free = [0.0] * workers  # when each worker finishes its queued shares
    held: list[int | None] = [None] * workers  # the version each worker holds
    launched: dict[int, float] = {}
    generated: dict[int, float] = {}
    out: list[StepTimes] = []
    train_end = verifier_free = 0.0
    grading: list[float] = []  # evaluations generated, not yet graded (when generated)

    def launch(t: int, at: float) -> None:
        version = policy.generation_version(t)
        launched[t] = at
        done = at
        for w, k in enumerate(shares):
            if not k:
                continue
            start = max(free[w], at)
            if held[w] != version:
                start += costs.reload_s
                held[w] = version
            free[w] = start + costs.generate_s * _fraction(k, prompts_per_step, slots)
            done = max(done, free[w])
        # Episodes: the job's hold keeps its workers until the last reply is in.
        for w, k in enumerate(shares):
            if k:
                free[w] = max(free[w], done) + costs.env_s
        generated[t] = done + costs.env_s

    for s in range(steps):
        begin = train_end  # step s begins when update s - 1 is done
        if eval_every > 0 and s % eval_every == 0:
            # Beside training: queued on every worker after the shares launched before it
            # (loading version s where the worker holds another), graded on the sandboxes
            # once generated; the controller goes on.
            for w in range(workers):
                start = max(free[w], begin)
                if held[w] != s:
                    start += costs.reload_s
                    held[w] = s
                free[w] = start + costs.eval_s
            grading.append(max(free))
        for t in range(s, min(steps, s + d + 1)):
            if t not in launched:
                launch(t, begin)
        # The verifiers take one step's rollouts at a time (their sandboxes are the limit),
        # and an evaluation's when it was generated first.
        while grading and grading[0] <= generated[s]:
            verifier_free = max(verifier_free, grading.pop(0)) + costs.eval_verify_s
        verified = max(generated[s], verifier_free) + costs.verify_s
        verifier_free = verified
        start = max(begin, verified)
        train_end = start + costs.train_s
        out.append(
            StepTimes(
                step=s,
                version=policy.generation_version(s),
                launched=launched[s],
                generated=generated[s],
                verified=verified,
                train_start=start,
                train_end=train_end,
                wait_s=start - begin,
            )
        )
    return Schedule(out)
