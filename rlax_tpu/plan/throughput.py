"""A discrete-event model of the controller's throughput schedule (``controller/throughput.py``).

What it models, as ``run_throughput`` does:

* At the top of each round the trainer is at version v and the workers serve w = reload_point(v).
  Groups are admitted with version w while the groups queued (in flight + buffered) are fewer
  than the admission budget B·(η_a − (v − w) + 1) (unbounded η_a: the queue cap, every worker's
  slots plus one batch).
* A worker runs up to ``slots`` groups at once (continuous batching: a group's latency does not
  depend on how many share the worker, up to the slots); an admitted group takes the slot where
  it can start first, over all workers (the pool gives it to the least-loaded worker). A worker
  that holds another version first lets its running groups finish, then loads w (``reload_s``),
  and none of its slots starts before that (the pool's epochs). With ``overlap``
  (``inference.overlap_reload``) it loads w at once instead, its running groups finishing on
  the older weights beside w's, unless a version older still runs there (two at most: the load
  waits for those to end). Not modelled: while two versions run, an engine step runs two
  programs, which at decode (weight-read bound) costs up to a second read of the weights. A
  group is buffered when its verification ends.
* The verifier: ``verifier_slots`` sandboxes (every verifier replica's) taking the groups'
  samples in the order their generation ended, each sample the slot free first, for ``check_s``
  seconds; a group is verified when its last sample is. ``verifier_slots`` 0: as many as there
  are samples (a group is verified ``check_s`` after its generation).
* The round waits until B buffered groups are acceptable (v − version ≤ η_a). A wait buffers
  every group done by then (the controller's ``cf.wait``) and discards the buffered groups older
  than η_a (their prompts are admitted again as new groups). If every admitted group has arrived
  and fewer than B are acceptable, the round admits more. With oldest-first consumption and equal
  group times nothing ages out (the budget sees to it); freshest-first can leave old groups
  behind, and latencies that vary (not drawn here) age some out too.
* The update takes the B oldest acceptable groups (with ``freshest_first`` the B newest, after
  the fewest oldest that later updates could not take in time: ``StalenessPolicy.consumption``) and
  ``train_s`` (π_old, update, publish); generation goes on meanwhile; then v + 1, the next round.
* Group lengths (``lengths``, :mod:`rlax_tpu.plan.lengths`): each group draws (occupancy,
  latency) factors; it holds its slot for occupancy x group_s and its generation ends after
  latency x group_s. Without them both are 1. Multi-turn episodes add ``env_s`` to a group's
  latency (its replies; ``costs.env_wait_s``), not to its slot's occupancy: a turn's slot is
  free while its reply is computed.
* A held-out evaluation at the top of rounds v = 0, k, 2k, ... (``eval_every`` = k > 0; the
  controller's ``_eval_due``) with version v runs beside training (controller/evaluation.py):
  on each worker it takes ``eval_share`` of the slots (at least one), those free first; a
  worker holding another version first lets its running groups finish and loads v (the pool's
  epochs: a group of another version then starts only once the evaluation is done, after a
  load back). Its generation takes ``eval_s`` (its time on every slot) scaled up by the share;
  once the last worker's is generated its checks take every sandbox for ``eval_verify_s``, in
  the verifier's order (the controller sends it in chunks, each checked before the next is
  generated: this packs the chunks' checks after the generation). The controller does not wait
  for it.

Costs per group (``ThroughputCosts``) come from a run's metrics or the AOT roofline.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable

from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.plan.simulate import mean_interval


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThroughputCosts:
    """Seconds of the pieces (module docstring)."""

    group_s: float  # one group's generation on a worker's slot
    check_s: float = 0.0  # one of its samples' verification on a sandbox slot
    train_s: float  # π_old, the update and the publish
    reload_s: float = 0.0  # a worker loading another version
    samples: int = 1  # a group's samples
    eval_s: float = 0.0  # one held-out evaluation's generation on the workers
    eval_verify_s: float = 0.0  # and its verification after it
    env_s: float = 0.0  # a group's episodes waiting on environment replies (latency only)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ThroughputCosts.{f.name} must be a finite number >= 0")
        if self.samples < 1:
            raise ValueError("ThroughputCosts.samples must be >= 1")


class _Verifier:
    """FIFO sandbox slots (module docstring): each sample of a group on the slot free first."""

    def __init__(self, slots: int, costs: ThroughputCosts):
        self.free = [0.0] * slots  # a heap of when each slot is free; [] unbounded
        self.costs = costs

    def first_start(self, generated: float) -> float:
        """When a group generated at ``generated`` would start its verification."""
        return max(generated, self.free[0]) if self.free else generated

    def occupy(self, at: float, seconds: float) -> None:
        """Every slot busy for ``seconds`` from when it is free after ``at`` (an evaluation's
        checks, ``seconds`` their time on all the slots)."""
        self.free = [max(at, f) + seconds for f in self.free]
        heapq.heapify(self.free)

    def run(self, generated: float) -> float:
        """Verify a group generated at ``generated``; returns when its last sample is done."""
        if not self.free:
            return generated + self.costs.check_s
        done = generated
        for _ in range(self.costs.samples):
            end = max(generated, heapq.heappop(self.free)) + self.costs.check_s
            heapq.heappush(self.free, end)
            done = max(done, end)
        return done


@dataclasses.dataclass(frozen=True)
class Update:
    """Update ``step``: when it ran, and the versions of the groups it consumed."""

    step: int
    train_start: float
    train_end: float
    versions: tuple[int, ...]
    wait_s: float  # from the round's start to the update's

    @property
    def staleness(self) -> tuple[int, ...]:
        return tuple(self.step - v for v in self.versions)


@dataclasses.dataclass(frozen=True)
class ThroughputSchedule:
    updates: list[Update]
    discarded: int = 0  # groups that aged past η_a in the buffer

    def seconds_per_update(self, skip: int = 1) -> float:
        """Mean seconds between consecutive update ends, after ``skip`` warm-up updates."""
        return mean_interval([u.train_end for u in self.updates], skip)

    def staleness_counts(self, skip: int = 0) -> dict[int, int]:
        """Groups consumed at each staleness, after ``skip`` updates."""
        out: dict[int, int] = {}
        for u in self.updates[skip:]:
            for s in u.staleness:
                out[s] = out.get(s, 0) + 1
        return dict(sorted(out.items()))


def simulate_throughput(
    steps: int,
    costs: ThroughputCosts,
    policy: StalenessPolicy,
    *,
    batch: int,
    slots: int,
    workers: int = 1,
    queue_cap: float = math.inf,
    freshest_first: bool = False,
    verifier_slots: int = 0,
    lengths: Callable[[], tuple[float, float]] | None = None,
    eval_every: int = 0,
    eval_share: float = 1.0,
    overlap: bool = False,
) -> ThroughputSchedule:
    """The schedule of ``steps`` updates of ``batch`` groups each (module docstring).
    ``slots``: groups a worker runs at once; ``queue_cap``: the queue under unbounded η_a;
    ``freshest_first``: the update takes the newest acceptable groups (controller.consume_order);
    ``verifier_slots``: the sandboxes verifying samples at once (0: unbounded); ``lengths``:
    draws a group's (occupancy, latency) factors; ``eval_every``: updates between held-out
    evaluations (0: none in the steady state), each on ``eval_share`` of every worker's slots;
    ``overlap``: a reload does not wait for the running groups (module docstring)."""
    if not 0.0 < eval_share <= 1.0:
        raise ValueError("eval_share must be in (0, 1]")
    if min(steps, batch, slots, workers) < 1:
        raise ValueError("steps, batch, slots and workers must be >= 1")
    if verifier_slots < 0:
        raise ValueError("verifier_slots must be >= 0 (0: unbounded)")
    free = [[0.0] * slots for _ in range(workers)]  # when each slot is free
    held: list[int | None] = [None] * workers
    older_until = [0.0] * workers  # when the groups of the version before held[w] end (overlap)
    verifier = _Verifier(verifier_slots, costs)
    generated: list[tuple[float, int, int]] = []  # (generated at, sequence, version)
    arriving: list[tuple[float, int, int]] = []  # (buffered at, sequence, version): verifying
    checks: list[float] = []  # evaluations generated (when), their checks not yet on sandboxes
    buffered: list[tuple[int, int]] = []  # (version, sequence) in arrival order
    seq = discarded = 0
    t, v = 0.0, 0
    evaluated = -1
    updates: list[Update] = []

    def loaded_at(w: int, at: float) -> float:
        """When worker w, holding another version, has loaded a new one asked for at ``at``."""
        if overlap:  # at once, once no version older than the held one runs
            return max(at, older_until[w]) + costs.reload_s
        # The worker's running groups drain (the pool's epochs), then it loads the version.
        return max(at, *free[w]) + costs.reload_s

    def load(w: int, version: int, at: float) -> float:
        """Worker w loads ``version`` (asked at ``at``); returns when it is loaded."""
        loaded = loaded_at(w, at)
        older_until[w] = max(free[w])  # the held version's running groups, on older weights
        held[w] = version
        free[w] = [max(f, loaded) for f in free[w]]  # no slot of it starts before the load
        return loaded

    def start_time(w: int, k: int, version: int, at: float) -> float:
        if held[w] == version:
            return max(at, free[w][k])
        return max(loaded_at(w, at), free[w][k])

    def admit(version: int, at: float) -> None:
        nonlocal seq
        w, k = min(
            ((w, k) for w in range(workers) for k in range(slots)),
            key=lambda wk: (start_time(*wk, version, at), wk),
        )
        start = start_time(w, k, version, at)
        if held[w] != version:
            load(w, version, at)
        occupancy, latency = lengths() if lengths is not None else (1.0, 1.0)
        free[w][k] = start + occupancy * costs.group_s
        done = start + latency * costs.group_s + costs.env_s
        heapq.heappush(generated, (done, seq, version))
        seq += 1

    def next_start() -> float:
        """When the next group generated would start its checks, after the evaluations'
        generated before it took the sandboxes."""
        while checks and checks[0] <= generated[0][0]:
            verifier.occupy(heapq.heappop(checks), costs.eval_verify_s)
        return verifier.first_start(generated[0][0])

    def verify_next() -> None:
        at, s, version = heapq.heappop(generated)
        heapq.heappush(arriving, (verifier.run(at), s, version))

    def verify_through(limit: float) -> None:
        # The verifier takes groups in the order their generation ended: one whose verification
        # starts by ``limit`` is committed (a group admitted later ends its generation later).
        while generated and next_start() <= limit:
            verify_next()

    def next_arrival() -> float:
        while True:
            first = arriving[0][0] if arriving else math.inf
            if not generated or next_start() >= first:
                return first
            verify_next()

    while len(updates) < steps:
        if eval_every > 0 and v % eval_every == 0 and evaluated < v:
            evaluated, ends = v, []
            reserved = max(1, math.floor(eval_share * slots))
            for w in range(workers):
                if held[w] != v:  # the epoch drains (or with overlap not), the worker loads v
                    load(w, v, t)
                taken = sorted(range(slots), key=lambda k: (free[w][k], k))[:reserved]
                start = max(t, *(free[w][k] for k in taken))
                ends.append(start + costs.eval_s * slots / reserved)
                for k in taken:
                    free[w][k] = ends[-1]
            heapq.heappush(checks, max(ends))
        w = policy.reload_point(v)
        limit = min(policy.admission_budget(batch, v, w), queue_cap)
        acceptable = sum(policy.accepts(v, b[0]) for b in buffered)
        if not arriving and not generated and len(buffered) >= limit and acceptable < batch:
            raise ValueError(f"nothing can be admitted at version {v} (budget {limit})")
        while len(generated) + len(arriving) + len(buffered) < limit:
            admit(w, t)
        round_start = t
        ready = [b for b in buffered if policy.accepts(v, b[0])]
        while len(ready) < batch and (arriving or generated):
            t = max(t, next_arrival())
            verify_through(t)
            # The controller's wait returns every job done by then, and buffers them all.
            while arriving and arriving[0][0] <= t:
                _, s, version = heapq.heappop(arriving)
                buffered.append((version, s))
            # ... and discards what aged past η_a (its prompt is admitted again, as a new group).
            stale = [b for b in buffered if not policy.accepts(v, b[0])]
            discarded += len(stale)
            buffered = [b for b in buffered if policy.accepts(v, b[0])]
            ready = buffered
        if len(ready) < batch:
            # Everything admitted has arrived: the controller's wait (on no jobs) discards what
            # aged past η_a, and the next round admits more.
            discarded += sum(not policy.accepts(v, b[0]) for b in buffered)
            buffered = [b for b in buffered if policy.accepts(v, b[0])]
            continue
        # buffered is in arrival order: ties keep it, as the controller's do.
        picks = policy.consumption(v, [b[0] for b in ready], batch, freshest_first=freshest_first)
        chosen = [ready[i] for i in picks]
        for b in chosen:
            buffered.remove(b)
        start = t
        t += costs.train_s
        updates.append(
            Update(
                step=v,
                train_start=start,
                train_end=t,
                versions=tuple(b[0] for b in chosen),
                wait_s=start - round_start,
            )
        )
        v += 1
    return ThroughputSchedule(updates, discarded)
