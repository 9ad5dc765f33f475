"""The controller's consumption: a step's batch drawn from verified groups, the update, the
groups marked trained, skipped updates, and the step's metrics."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

import numpy as np

from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller import samples as samples_lib
from rlax_tpu.observability.samples import write_samples
from rlax_tpu.types import Rollout

log = logging.getLogger(__name__)


class NothingToLearn(RuntimeError):
    """Too many updates in a row had every group filtered (controller.max_skipped_updates)."""


def _turns(rollout: Rollout) -> int:
    """The model turns of an episode: runs of sampled tokens."""
    if rollout.sampled is None:
        return 1
    s = np.asarray(rollout.sampled, bool)
    return int(s[:1].sum() + (s[1:] & ~s[:-1]).sum())


class ConsumptionMixin:
    """Controller methods: training on verified groups and the step's metrics (see loop.Controller)."""

    def train(self, results: Sequence[groups_lib.GroupResult]) -> dict[str, float] | None:
        """One update on ``results`` (all within η_a); ledger and counters follow. None: the
        update is skipped, as nothing is left to learn from (every group filtered or failed);
        step and version stay, and the step's groups are finished all the same."""
        for r in results:
            if not self.policy.accepts(self.version, r.version):
                raise AssertionError(f"group {r.key}: staleness {self.version - r.version} > η_a")
        self.publishes.check()  # a version pushed in the background that did not land
        extra: dict[str, float] = {}
        consumed: list[str] = []  # fresh groups the ledger marks trained at this update
        if self.replay is not None:
            # The step's groups join the buffer (trained from it, this update or later); the
            # batch is drawn from it.
            consumed = [r.key for r in results if not r.verifier_failed]
            batch_groups = self._draw(results, extra)
        else:
            batch_groups = results
        plan = groups_lib.plan_batch(
            batch_groups,
            self.objective,
            group_size=self.group_size,
            temperature=self.config.inference.temperature,
            max_groups=self.cc.prompts_per_step,
            # A MoE worker's routes go to the trainer only if it replays them (they are
            # layers x k entries a token).
            routes=self.config.trainer.routing_replay != "off",
        )
        if self.replay is None:
            consumed = plan.trained
            for keys, reason in (
                (plan.filtered, "filtered"),
                (plan.failed, "verifier_failed"),
                (plan.surplus, "surplus"),
            ):
                for key in keys:
                    self.ledger.discard(key, reason=reason)
        else:
            for r in results:
                if r.verifier_failed:
                    self.ledger.discard(r.key, reason="verifier_failed")
            self.counters.groups_replayed += len(plan.trained)
        self.counters.groups_filtered += len(plan.filtered)
        self.counters.groups_verifier_failed += sum(r.verifier_failed for r in results)
        self.counters.groups_surplus += len(plan.surplus)
        for r in results:
            self.buffered.pop(r.key, None)
            self.refs.pop(r.key, None)
        if plan.batch is None:
            self._mark_trained(consumed)  # with replay they are in the buffer all the same
            self._skip(len(batch_groups))
            return None
        self.counters.skipped_in_a_row = 0
        t0 = time.perf_counter()
        # expect_step: a trainer that restarted unseen (between two calls) refuses the update.
        metrics = self.c.trainer.train_step(plan.batch, expect_step=self.version)
        train_s = time.perf_counter() - t0
        self._mark_trained(consumed)  # only once the update happened
        self.version += 1
        self.step += 1
        self._record_samples(batch_groups, plan.trained)
        self.profile_workers()
        self.publishes.published(
            self.version,
            float(metrics.get("time_since_publish_s", 0.0)),
            pending=bool(metrics.get("publish_pending", 0.0)),
        )
        return (
            {f"trainer/{k}": float(v) for k, v in metrics.items()}
            | extra
            | {"time/train": train_s, "groups/trained": float(len(plan.trained))}
        )

    def profile_workers(self) -> None:
        """observability.profile_steps on the workers: update s is traced from the end of
        update s - 1 (or the run's start) to its own end. A worker that cannot is named in a
        warning; the run goes on."""
        steps = self.config.observability.profile_steps
        for step, start in ((self.step, False), (self.step + 1, True)):
            if step not in steps:
                continue
            for i in self.pool.live:
                try:
                    self.c.workers[i].profile(step, start=start)
                except Exception as e:  # noqa: BLE001 - a profile, never a reason to stop
                    self._warn(f"worker {i} could not trace step {step}: {type(e).__name__}: {e}")

    def _record_samples(self, groups: Sequence[groups_lib.GroupResult], trained: list[str]) -> None:
        """observability.samples_per_step rollouts of the update just made, to the run
        directory now (a step done again after a resume replaces its file) and to the sinks
        with the step's metrics (``_log``)."""
        k = self.config.observability.samples_per_step
        if not k:
            return
        kept = set(trained)
        self.step_samples = samples_lib.draw(
            [g for g in groups if g.key in kept],  # the batch's rows, in its order
            getattr(self.c.trainer, "last_row_advantages", None),
            k=k,
            seed=self.cc.seed,
            step=self.step,
            version=self.version - 1,
            decode=self.prompter.decode,
        )
        write_samples(self.run_dir, self.step, self.step_samples)

    def _draw(
        self, results: Sequence[groups_lib.GroupResult], metrics: dict[str, float]
    ) -> list[groups_lib.GroupResult]:
        """data.replay: adds the step's groups to the buffer, draws the update's groups."""
        new = self.replay.add(results)
        drawn = self.replay.draw(self.cc.prompts_per_step, self.version)
        ages = [self.version - ro.version for g in drawn for ro in g.rollouts]
        metrics |= {
            "replay/items": float(len(self.replay.buffer)),
            "replay/added": float(new),
            "replay/recent_fraction": float(np.mean([g.replayed == "recent" for g in drawn]))
            if drawn
            else 0.0,
            "replay/staleness_mean": float(np.mean(ages)) if ages else 0.0,
            "replay/staleness_max": float(max(ages, default=0)),
        }
        return drawn

    def _mark_trained(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.ledger.train(key, at_version=self.version)
        self.counters.groups_trained += len(keys)

    def _skip(self, groups: int) -> None:
        c = self.counters
        c.updates_skipped += 1
        c.skipped_in_a_row += 1
        self._warn(
            f"step {self.step}: nothing to learn from its {groups} groups (every one "
            f"filtered or failed); update skipped, the step is drawn again "
            f"({c.skipped_in_a_row} in a row)"
        )
        if c.skipped_in_a_row > self.cc.max_skipped_updates:
            raise NothingToLearn(
                f"{c.skipped_in_a_row} updates in a row had nothing to learn (every group's "
                "rewards equal, or the verifier failed): the data is too hard or too easy for the "
                "model, or the verifier is broken. controller.max_skipped_updates = "
                f"{self.cc.max_skipped_updates}; a resume continues from the newest snapshot"
            )

    def step_metrics(self, results: Sequence[groups_lib.GroupResult]) -> tuple[dict, dict]:
        rewards = np.concatenate([np.nan_to_num(r.rewards, nan=0.0) for r in results])
        gen = [r.timing for r in results if r.timing]
        tokens = sum(r.tokens() for r in results)
        gen_s = max((t["generated"] - t["launched"] for t in gen), default=0.0)
        ver_s = max((t["verified"] - t["generated"] for t in gen), default=0.0)
        lengths = [len(ro.tokens) for r in results for ro in r.rollouts]
        scalars = {
            "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward/pass_rate": float((rewards > 0).mean()) if rewards.size else 0.0,
            "throughput/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
            "rollout/length_mean": float(np.mean(lengths)) if lengths else 0.0,
            "time/generate": gen_s,
            "time/verify": ver_s,
            "groups/discarded_stale": float(self.counters.groups_discarded_stale),
            "groups/filtered": float(self.counters.groups_filtered),
            "groups/refilled": float(self.counters.groups_refilled),
            "updates/skipped": float(self.counters.updates_skipped),
            "groups/verifier_failed": float(self.counters.groups_verifier_failed),
        }
        # The workers' load and generation seconds since the last step (the planner's costs).
        times = self.pool.take_times()
        scalars |= {f"pool/{k}": v for k, v in times.items()}
        loads = times["loads"] + times["eval_loads"]
        self.weights_received[0] += times["wire_bytes"]
        self.weights_received[1] += int(loads)
        if loads:  # what a version costs the network (0: every load device to device)
            scalars["weights/wire_bytes_per_load"] = times["wire_bytes"] / loads
        served = self.pool.take_publish_to_serve()
        if served:  # a version from the trainer's publish to the last worker serving it
            scalars["time/publish_to_serve"] = max(served)
            self.publish_to_serve += served
        scalars |= {
            f"verdict/{k}": float(v) for k, v in groups_lib.verdict_counts(results).items() if v
        }
        # How the step's samples ended: eos, length (truncated), stop (a stop string), aborted.
        ended = collections.Counter(ro.finish_reason.value for r in results for ro in r.rollouts)
        total = sum(ended.values())
        scalars |= {f"rollout/finish_{k}": n / total for k, n in ended.items()}
        if self.episodes is not None:
            turns = [_turns(ro) for r in results for ro in r.rollouts]
            scalars["episode/turns_mean"] = float(np.mean(turns)) if turns else 0.0
            # Environment calls that raised or timed out since the last step (evaluations' too):
            # each ended its episode, and its group was not trained on.
            failed = self.episodes.take_failures()
            scalars |= {f"episode/environment_{k}": float(n) for k, n in failed.items()}
            reused = self._prefix_tokens_reused()
            if reused is not None:  # later turns on kept pages: not computed again
                scalars["episode/prefix_tokens_reused"] = reused
            first = [r.first_rewards for r in results if r.first_rewards is not None]
            if first:  # against reward/pass_rate: what the later turns added
                scalars["episode/first_turn_pass_rate"] = float(
                    (np.nan_to_num(np.concatenate(first)) > 0).mean()
                )
        hist = {
            "staleness": [float(self.version - r.version) for r in results],
            # G a group, in the groups' order: the planner's length distribution of a run.
            "lengths/trained": [float(n) for n in lengths],
        }
        return scalars, hist

    def _prefix_tokens_reused(self) -> float | None:
        """Tokens the live workers took from kept pages since the last call (None: none
        answered; a worker that did not is counted at its next answer)."""
        total, answered = 0, False
        for i in self.pool.live:
            try:
                now = int(self.c.workers[i].status().prefix_tokens_reused)
            except Exception:  # noqa: BLE001 - a metric, never a reason to stop
                continue
            last = self._reused.get(i, 0)
            total += now - last if now >= last else now  # a restarted worker counts from 0
            self._reused[i], answered = now, True
        return float(total) if answered else None
