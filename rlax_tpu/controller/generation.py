"""The controller's generation: training problems (mixture, prefilter), issuing prompt groups,
launching them on the worker pool (as episodes where an environment is set), collecting their
verified results, and dynamic sampling's refills."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from rlax_tpu import storage
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller.consumption import NothingToLearn
from rlax_tpu.data.filters import prefilter
from rlax_tpu.data.mixture import PromptMixture, PromptRef

log = logging.getLogger(__name__)

PREFILTER_FILE = "prefilter.json"


class GenerationMixin:
    """Controller methods: issuing, launching and collecting prompt groups (see loop.Controller)."""

    def _mixture(self, keep: set[str] | None) -> PromptMixture:
        """The prompt mixture over the training problems (``keep``: "dataset/id" keys only)."""
        train = {
            n: [p.id for p in ps if keep is None or f"{n}/{p.id}" in keep]
            for n, ps in self.prompter.datasets.train.items()
        }
        train = {n: ids for n, ids in train.items() if ids}
        weights = dict(zip(self.config.data.datasets, self.config.data.weights, strict=True))
        return PromptMixture(train, {n: weights[n] for n in train}, seed=self.cc.seed)

    def _prefiltered(self) -> set[str] | None:
        path = self.run_dir / PREFILTER_FILE
        if not self.config.data.prefilter_samples:
            return None
        return set(json.loads(path.read_text())["kept"]) if path.exists() else None

    def prefilter(self) -> None:
        """RLAX's pre-filtering: measures the training problems' pass rates with this version
        and keeps the partially solved ones (``data.prefilter_*``); the result goes to
        ``<run_dir>/prefilter.json`` and the mixture draws from the kept problems only."""
        d = self.config.data
        k, cap = d.prefilter_samples, d.prefilter_problems
        problems = [
            (f"{n}/{p.id}", p)
            for n, ps in self.prompter.datasets.train.items()
            for p in (ps[:cap] if cap else ps)
            if self.prompter.fits(p)
        ]
        self._event(
            f"pre-filtering {len(problems)} training problems: {k} samples each at "
            f"version {self.version}"
        )
        self.ensure_versions([self.version])
        counts: dict[str, int] = {}
        chunk = max(1, 256 // k)
        for i in range(0, len(problems), chunk):
            counts |= self._pass_counts(problems[i : i + chunk], k, stream="prefilter")
            self._event(f"pre-filtering: {min(i + chunk, len(problems))}/{len(problems)} problems")
        rates = {key: c / k for key, c in counts.items()}
        result = prefilter(rates, low=d.prefilter_low, high=d.prefilter_high)
        summary = (
            f"{len(result.kept)} of {len(rates)} problems kept, "
            f"{len(result.dropped_solved)} solved at rate >= {d.prefilter_high}, "
            f"{len(result.dropped_unsolved)} at rate <= {d.prefilter_low}"
        )
        if not result.kept:
            raise NothingToLearn(
                f"pre-filtering kept no training problem ({summary}); widen "
                "data.prefilter_low/prefilter_high or turn it off"
            )
        storage.write_atomic(
            self.run_dir / PREFILTER_FILE,
            json.dumps(
                {
                    "version": self.version,
                    "samples": k,
                    "low": d.prefilter_low,
                    "high": d.prefilter_high,
                    "pass_rates": rates,
                    "kept": list(result.kept),
                    "dropped_solved": list(result.dropped_solved),
                    "dropped_unsolved": list(result.dropped_unsolved),
                },
                indent=1,
            ),
        )
        self._event(f"pre-filtering: {summary}")
        self.mixture = self._mixture(set(result.kept))

    def _launch(
        self, refs: Sequence[PromptRef], version: int, *, issued_version: int = 0
    ) -> cf.Future[list[groups_lib.GroupResult]]:
        for ref in refs:
            self.ledger.start(ref.key)
        requests = [self.prompter.request(r.key, self.prompter.problem(r)) for r in refs]
        timing = {"launched": time.perf_counter()}
        # A version still being pushed: the job reaches the pool once it is published (the
        # controller goes on meanwhile).
        if self.episodes is not None:  # generated and played out
            problems = {r.key: self.prompter.problem(r) for r in refs}
            generation = self.publishes.after(
                version, lambda: self.episodes.start(version, requests, problems)
            )
        else:
            generation = self.publishes.after(version, lambda: self.pool.submit(version, requests))

        def verify() -> list[groups_lib.GroupResult]:
            out = generation.result()
            timing["generated"] = time.perf_counter()
            first = None
            if self.episodes is not None:  # the environment's rewards, not algorithm.reward's
                rollouts, verdicts = out.episodes, out.verdicts
                rewards, first = out.rewards, out.first_rewards
                timing["verified"] = timing["generated"]
            else:
                rollouts = out
                by_key = {r.key: r for r in refs}
                items = [(self.prompter.problem(by_key[ro.prompt_id]), ro) for ro in rollouts]
                verdicts = groups_lib.verify(self.c.verifier, self.specs, self.prompter, items)
                timing["verified"] = time.perf_counter()
                rewards = groups_lib.rewards_of(
                    self.config.algorithm.reward, self.prompter, items, verdicts
                )
            results = groups_lib.results_from(
                refs, rollouts, verdicts, rewards, issued_version=issued_version
            )
            if first is not None:
                where = {
                    (ro.prompt_id, ro.sample_index): f
                    for ro, f in zip(rollouts, first, strict=True)
                }
                for r in results:
                    r.first_rewards = np.array(
                        [where[ro.prompt_id, ro.sample_index] for ro in r.rollouts]
                    )
            for r in results:
                r.timing = dict(timing)
            return results

        if self.episodes is None:
            return self._verify_pool.submit(verify)
        # Episodes are graded by their environment: results are built when the play ends, on
        # no thread of the verify pool (a slow play would hold finished ones back).
        results: cf.Future[list[groups_lib.GroupResult]] = cf.Future()

        def played(_: cf.Future) -> None:
            try:
                results.set_result(verify())
            except BaseException as e:  # noqa: BLE001 - raised by _collect
                results.set_exception(e)

        generation.add_done_callback(played)
        return results

    def _collect(
        self, job: cf.Future[list[groups_lib.GroupResult]]
    ) -> list[groups_lib.GroupResult]:
        results = job.result()
        for r in results:
            self.ledger.finish(r.key, version=r.version)
            self.buffered[r.key] = r
        return results

    def learnable(self, result: groups_lib.GroupResult) -> bool:
        """The group would be trained on: verified, and kept by dynamic sampling if it is on."""
        if result.verifier_failed:
            return False
        keep, _ = self.objective.filter_groups(result.rewards[None])
        return bool(keep[0])

    def _refill(
        self, s: int, results: list[groups_lib.GroupResult]
    ) -> list[groups_lib.GroupResult]:
        """DAPO's dynamic sampling: while fewer than prompts_per_step groups of step ``s`` are
        learnable, draw more prompts for it (generated with the step's version), at most
        controller.refill_rounds times. A round draws the shortfall over the rate kept so far
        (at least 1 in prompts_per_step), at most a full batch."""
        if not self.objective.spec.dynamic_sampling or self.replay is not None:
            return results  # with replay the batch is drawn from the buffer, not these groups
        target = self.cc.prompts_per_step
        for _ in range(self.cc.refill_rounds):
            kept = sum(self.learnable(r) for r in results)
            if kept >= target:
                break
            rate = max(kept / len(results), 1 / target)
            refs = self.issue(min(target, math.ceil((target - kept) / rate)), step=s)
            self.counters.groups_refilled += len(refs)
            version = self.policy.generation_version(s)
            results = [*results, *self._collect(self._launch(refs, version))]
        return results

    def issue(self, n: int, *, step: int = -1) -> list[PromptRef]:
        refs = [self._fit(self.mixture.next()) for _ in range(n)]
        for ref in refs:
            self.ledger.issue(ref.key, step=step)
            self.refs[ref.key] = ref
        return refs

    def _fit(self, ref: PromptRef) -> PromptRef:
        # Prompts longer than the workers take are skipped at draw time (deterministically).
        for _ in range(1000):
            if self.prompter.fits(self.prompter.problem(ref)):
                return ref
            self.counters.prompts_too_long += 1
            ref = self.mixture.next()
        raise RuntimeError("1000 prompts in a row exceed inference.max_prompt_len")
