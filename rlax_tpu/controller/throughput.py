"""Throughput mode: continuous generation under the admission budget (DESIGN.md §3).

Workers hold the newest reload point w = η_r·⌊v/η_r⌋ of the trainer's version v. A prompt group is
admitted only while the groups queued ahead of the trainer (in flight + buffered, q) satisfy
q < B·(η_a − (v − w) + 1) (``StalenessPolicy.admits``; AReaL's B·(1 + η_a) when w = v), so a
rollout is rarely too stale by the time the trainer reaches it. The trainer takes B groups within
η_a, oldest first (or freshest first, RLAX's choice, after the fewest oldest that later updates
could not take before they age out). A group that aged out anyway is discarded,
counted, and its prompt re-issued ahead of new prompts, never lost; the length distribution of
trained vs generated rollouts is logged so the bias that discarding could cause is visible.
Dynamic sampling filters a group as it arrives, so admission refills the batch; after
controller.refill_rounds batches' worth of filtered groups the trainer takes what is ready (an
update with nothing is skipped). With η_a = ∞ (``acceptance_staleness = -1``) the budget is infinite, so the queue is capped at
what keeps the workers busy: the groups they hold at once plus one buffered batch
(:func:`throughput_queue_cap`).
Not bitwise reproducible (timing decides which groups share a step), but the ledger guarantees no
group is lost or trained twice, across restarts too.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rlax_tpu.controller.ledger import GroupState
from rlax_tpu.data.mixture import PromptRef
from rlax_tpu.observability.metrics import MetricsWriter
from rlax_tpu.observability.progress import Progress

if TYPE_CHECKING:
    import concurrent.futures as cf

    from rlax_tpu.algorithms import Objective
    from rlax_tpu.config import ControllerConfig, RunConfig
    from rlax_tpu.controller.groups import GroupResult
    from rlax_tpu.controller.ledger import Ledger
    from rlax_tpu.controller.pool import WorkerPool
    from rlax_tpu.controller.publishes import Publishes
    from rlax_tpu.controller.staleness import StalenessPolicy


class Controller(Protocol):
    """What the throughput schedule reads and drives of the controller (``loop.Controller``,
    which dispatches here; declared here so this module does not import the loop back)."""

    config: RunConfig
    cc: ControllerConfig
    objective: Objective
    ledger: Ledger
    buffered: dict[str, GroupResult]
    refs: dict[str, PromptRef]
    counters: Any  # loop.Counters
    pool: WorkerPool
    publishes: Publishes
    policy: StalenessPolicy
    step: int
    version: int

    def snapshot(self) -> None: ...
    def train(self, results: Sequence[GroupResult]) -> dict[str, float] | None: ...
    def step_metrics(self, results: Sequence[GroupResult]) -> tuple[dict, dict]: ...
    def lease(self, versions: Iterable[int]) -> None: ...
    def learnable(self, result: GroupResult) -> bool: ...
    def issue(self, n: int, *, step: int = -1) -> list[PromptRef]: ...
    def ensure_versions(self, versions: Sequence[int]) -> None: ...
    def start_eval_if_due(self) -> None: ...
    def log_evals(
        self, metrics: MetricsWriter, progress: Progress, *, wait: bool = False
    ) -> None: ...
    def _log(
        self, metrics: MetricsWriter, progress: Progress, scalars: dict, hist: dict
    ) -> None: ...
    def _skip(self, groups: int) -> None: ...
    def _launch(
        self, refs: Sequence[PromptRef], version: int, *, issued_version: int = 0
    ) -> cf.Future[list[GroupResult]]: ...
    def _collect(self, job: cf.Future[list[GroupResult]]) -> Any: ...


def throughput_queue_cap(config: RunConfig) -> int:
    """Groups queued (in flight + buffered) under unbounded staleness: every worker's sequence
    slots filled with groups, plus one batch waiting for the trainer."""
    inf, g = config.inference, config.algorithm.group_size
    return (
        inf.num_workers * max(1, inf.max_concurrent_seqs // g) + config.controller.prompts_per_step
    )


def launch_chunk(batch: int) -> int:
    """Groups the throughput loop launches as one job (half a batch; the planner models it)."""
    return max(1, batch // 2)


def run_throughput(ctl: Controller, metrics: MetricsWriter, progress: Progress) -> None:
    cc, policy = ctl.cc, ctl.policy
    batch, n = cc.prompts_per_step, cc.num_steps
    chunk = launch_chunk(batch)
    cap = throughput_queue_cap(ctl.config) if math.isinf(policy.acceptance_staleness) else math.inf
    reissue: collections.deque[PromptRef] = collections.deque()
    for key in ctl.ledger.unfinished():  # from a snapshot: generated again, newest weights
        if ctl.ledger[key].state is GroupState.IN_FLIGHT:
            ctl.ledger.requeue(key)
        reissue.append(ctl.refs[key])
    jobs: dict[cf.Future, tuple[int, int]] = {}  # future -> (groups, version generated with)
    finish_seq = {}  # group key -> order it was buffered in, for the consumption order
    ctl.ensure_versions([ctl.version, policy.reload_point(ctl.version)])
    last_log, tokens_at_log = time.perf_counter(), ctl.pool.generated_tokens
    # The pool counts this process's tokens; a resumed run adds them to what it had counted.
    tokens_before, pool_at_start = ctl.counters.tokens_generated, ctl.pool.generated_tokens
    generated_lengths: list[float] = []
    filtered = 0  # groups dynamic sampling dropped since the last update
    give_up = (1 + cc.refill_rounds) * batch
    while ctl.step < n:
        ctl.start_eval_if_due()  # runs beside training
        ctl.log_evals(metrics, progress)
        v = ctl.version
        # The reload point, or an older one while its version is still being pushed.
        w = ctl.publishes.newest_ready(v, policy.reload_point)
        in_flight = sum(groups for groups, _ in jobs.values())
        queued = in_flight + len(ctl.buffered)
        limit = min(policy.admission_budget(batch, v, w), cap)  # policy.admits, capped
        while queued < limit:
            k = int(min(chunk, math.ceil(limit - queued)))
            refs = [reissue.popleft() if reissue else ctl.issue(1)[0] for _ in range(k)]
            jobs[ctl._launch(refs, w, issued_version=v)] = (len(refs), w)
            queued += len(refs)
        # Jobs in flight too: an episode's later turns may still load its version.
        ctl.lease({w, *(g for _, g in jobs.values()), *(r.version for r in ctl.buffered.values())})
        t_wait = time.perf_counter()
        ready = _take_ready(ctl, v)
        while len(ready) < batch:
            if not jobs and w != policy.reload_point(v):
                # Nothing in flight, and the budget of the older version held back: wait for
                # the push rather than go round again at once.
                ctl.publishes.wait(policy.reload_point(v))
                break
            done, _ = cf.wait(list(jobs), return_when=cf.FIRST_COMPLETED)
            for fut in done:
                del jobs[fut]
                for r in ctl._collect(fut):
                    finish_seq[r.key] = len(finish_seq)
                    generated_lengths += [float(len(ro.tokens)) for ro in r.rollouts]
                    filtered += _drop_filtered(ctl, r)
            _discard_stale(ctl, v, reissue)
            ready = _take_ready(ctl, v)
            if len(ready) < batch and (not jobs or filtered >= give_up):
                break  # everything admitted is buffered (admit more), or refilled enough
        if len(ready) < batch and filtered < give_up:
            continue
        if not ready:
            ctl.snapshot()
            ctl._skip(filtered)
            filtered = 0
            continue
        filtered = 0
        wait_s = time.perf_counter() - t_wait
        chosen = choose(ready, batch, v, policy, cc.consume_order, finish_seq)
        ctl.counters.tokens_generated = tokens_before + ctl.pool.generated_tokens - pool_at_start
        ctl.snapshot()
        scalars, hist = ctl.step_metrics(chosen)
        now = time.perf_counter()
        scalars["throughput/tokens_per_s"] = (ctl.pool.generated_tokens - tokens_at_log) / max(
            now - last_log, 1e-9
        )
        last_log, tokens_at_log = now, ctl.pool.generated_tokens
        hist["lengths/generated"], generated_lengths = generated_lengths, []
        trained = ctl.train(chosen)
        if trained is None:  # every chosen group failed verification
            continue
        scalars |= trained | {"time/wait": wait_s, "groups/queued": float(queued)}
        ctl._log(metrics, progress, scalars, hist)
    ctl.start_eval_if_due()
    ctl.log_evals(metrics, progress, wait=True)
    ctl.snapshot()


def choose(
    ready: Sequence[GroupResult],
    batch: int,
    version: int,
    policy: StalenessPolicy,
    order: str,
    finish_seq: dict[str, int],
) -> list[GroupResult]:
    """The ``batch`` groups the update from ``version`` trains, by ``controller.consume_order``
    (``StalenessPolicy.consumption``), ties in the order they were buffered (``finish_seq``)."""
    ready = sorted(ready, key=lambda r: finish_seq.get(r.key, 0))
    picks = policy.consumption(
        version, [r.version for r in ready], batch, freshest_first=order == "freshest_first"
    )
    return [ready[i] for i in picks]


def _take_ready(ctl: Controller, version: int) -> list:
    return [r for r in ctl.buffered.values() if ctl.policy.accepts(version, r.version)]


def _drop_filtered(ctl: Controller, result: GroupResult) -> int:
    """1 if dynamic sampling drops ``result`` on arrival (finished as filtered), else 0."""
    if not ctl.objective.spec.dynamic_sampling or result.verifier_failed or ctl.learnable(result):
        return 0
    ctl.ledger.discard(result.key, reason="filtered")
    del ctl.buffered[result.key]
    ctl.refs.pop(result.key, None)
    ctl.counters.groups_filtered += 1
    return 1


def _discard_stale(ctl: Controller, version: int, reissue: collections.deque) -> None:
    """Last resort: a buffered group past η_a is discarded and its prompt re-issued first."""
    for key, r in list(ctl.buffered.items()):
        if ctl.policy.accepts(version, r.version):
            continue
        again = dataclasses.replace(r.ref, retry=r.ref.retry + 1)
        ctl.ledger.issue(again.key)
        ctl.refs[again.key] = again
        ctl.ledger.discard(key, reason="stale", replaced_by=again.key)
        del ctl.buffered[key]
        ctl.refs.pop(key, None)
        ctl.counters.groups_discarded_stale += 1
        reissue.appendleft(again)
