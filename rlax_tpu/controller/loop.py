"""The step loop: the only active part of the system (DESIGN.md §3-4).

Deterministic mode. Training step s consumes the prompt batch P_s (the next
``prompts_per_step`` prompts of the mixture, drawn in step order) generated with version
g(s) = η_r·⌊max(0, s − d)/η_r⌋ (``StalenessPolicy.generation_version``). At the top of step s the
trainer holds version s, so every step t ≤ s + d has its version and is launched: generation of
steps s+1 … s+d overlaps the training of step s. Per-group sampling seeds, a batch-invariant engine
and a deterministic trainer make the run bitwise reproducible for a fixed topology.

Throughput mode (``throughput.py``) shares the state, snapshots and logging below.

Snapshots are written before each update (a weight-reload boundary): version, mixture state,
ledger, the verified groups waiting for the trainer (their rollouts), counters. Resume takes the
newest snapshot whose version has a complete trainer checkpoint, restores both, republishes any
version the parameter server lost, and re-issues exactly the groups the ledger says are unfinished.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlax_tpu import storage
from rlax_tpu.algorithms import Objective, make_objective
from rlax_tpu.config import RunConfig, diff, from_dict, to_dict
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller.components import Components
from rlax_tpu.controller.ledger import GroupState, Ledger
from rlax_tpu.controller.pool import WorkerPool
from rlax_tpu.controller.snapshots import LEDGER_DIR, LedgerLog, SnapshotStore
from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.controller.tasks import SpecCache
from rlax_tpu.data.evaluation import mean_pass_at_k
from rlax_tpu.data.mixture import PromptMixture, PromptRef
from rlax_tpu.observability.metrics import MetricsWriter
from rlax_tpu.observability.progress import Progress
from rlax_tpu.trainer import CorruptCheckpointError

log = logging.getLogger(__name__)

# Fields a resumed run may change; any other difference is an incompatible config.
RESUMABLE_FIELDS = (
    "controller.num_steps", "controller.log_every", "controller.rpc_timeout_s",
    "controller.recovery_timeout_s", "controller.compilation_cache", "controller.snapshot_keep",
    "trainer.keep_checkpoints",
    "controller.transport", "controller.trainer_process", "controller.trainer_cpus",
    "controller.inference_endpoints", "controller.verifier_endpoint",
    "controller.trainer_endpoint", "controller.param_server_endpoints",
    "controller.auth_token_file", "controller.run_dir", "data.eval_every", "data.data_dir",
    "inference.num_workers", "inference.address", "trainer.address", "trainer.precompile",
    "verifiers.address", "verifiers.python_check",
    "param_server.address", "verifiers.workers", "verifiers.sandbox_uid",
)  # fmt: skip


class IncompatibleResume(ValueError):
    """The run directory holds a run with a different config."""


@dataclasses.dataclass
class Counters:
    groups_trained: int = 0
    groups_discarded_stale: int = 0
    groups_filtered: int = 0
    groups_verifier_failed: int = 0
    tokens_generated: int = 0
    prompts_too_long: int = 0  # drawn from the mixture but longer than inference.max_prompt_len
    last_eval_version: int = -1


@dataclasses.dataclass
class RunSummary:
    run_dir: str
    steps_done: int
    version: int
    already_finished: bool
    counters: dict[str, Any]
    evals: dict[int, dict[str, float]]  # version -> eval metrics
    wall_s: float
    weights_sha256: str = ""  # of the final parameters (local transport), for reproducibility


class Controller:
    """Drives the components of ``components`` for ``config.controller.num_steps`` updates."""

    def __init__(
        self, config: RunConfig, components: Components, prompter: groups_lib.Prompter, *,
        run_dir: str | Path, progress_stream: Any = None, on_event: Callable[[str], None] | None = None,
    ):  # fmt: skip
        self.config, self.c = config, components
        cc = config.controller
        self.cc = cc
        self.run_dir = storage.path(run_dir)
        self.prompter = prompter
        self.objective: Objective = make_objective(config.algorithm,
                                                   max_length=config.inference.max_new_tokens)  # fmt: skip
        self.policy = StalenessPolicy(
            reload_staleness=cc.reload_staleness, acceptance_staleness=cc.acceptance_bound,
            pipeline_depth=cc.pipeline_depth if cc.mode == "deterministic" else 0,
        )  # fmt: skip
        self.group_size = config.algorithm.group_size
        datasets = prompter.datasets
        self.mixture = PromptMixture(
            {n: [p.id for p in ps] for n, ps in datasets.train.items()},
            dict(zip(config.data.datasets, config.data.weights, strict=True)), seed=cc.seed,
        )  # fmt: skip
        self.ledger = Ledger()
        self.refs: dict[str, PromptRef] = {}  # group key -> ref, for unfinished groups
        self.buffered: dict[str, groups_lib.GroupResult] = {}
        self.counters = Counters()
        self.snapshots = SnapshotStore(self.run_dir / "snapshots", keep=cc.snapshot_keep)
        self.ledger_log = LedgerLog(self.run_dir / LEDGER_DIR)
        self.ledger_segments = 0  # segments of ledger_log the newest snapshot covers
        self._split: dict[str, tuple[dict, dict]] = {}
        self.specs = SpecCache(components.verifier)
        self._event = on_event or (lambda text: print(text, flush=True))
        self.pool = WorkerPool(components.workers, retry_s=cc.rpc_timeout_s, on_event=self._warn,
                               exclusive_jobs=cc.mode == "deterministic")  # fmt: skip
        self.version = 0
        self.step = 0
        self.evals: dict[int, dict[str, float]] = {}
        self._progress_stream = progress_stream
        self._jobs: dict[int, cf.Future] = {}  # deterministic: step -> verified groups
        self._verify_pool = cf.ThreadPoolExecutor(2, "verify")

    def _warn(self, text: str) -> None:
        # Shown once, in the run's output; the log keeps it below the terminal's WARNING level
        # (it printed every warning twice, once on each stream).
        log.info("warning: %s", text)
        self._event(f"warning: {text}")

    # ------------------------------------------------------------------ state and snapshots
    def _payload(self) -> dict[str, Any]:
        return {
            "config": to_dict(self.config),
            "step": self.step,
            "version": self.version,
            "mixture": self.mixture.state(),
            "ledger": self.ledger.live_state(),
            "ledger_segments": self.ledger_segments,
            "refs": {k: dataclasses.asdict(r) for k, r in self.refs.items()},
            "buffered": {k: self._split[k][0] for k in self.buffered},
            "counters": dataclasses.asdict(self.counters),
            "evals": {str(v): m for v, m in self.evals.items()},
            "done": self.step >= self.cc.num_steps,
        }

    def snapshot(self) -> None:
        closed = self.ledger.take_closed()
        if closed:  # before the snapshot that counts it
            self.ledger_log.write(self.ledger_segments, closed)
            self.ledger_segments += 1
        self._split = {k: g.split_state() for k, g in self.buffered.items()}
        # The state as JSON (the mixture's RNG state holds 128-bit ints msgpack cannot carry),
        # the buffered rollouts as arrays beside it.
        self.snapshots.save(self.step, {"json": json.dumps(self._payload()),
                                        "rollouts": {k: a for k, (_, a) in self._split.items()}})

    def check_compatible(self, saved: dict[str, Any]) -> None:
        old = from_dict(type(self.config), saved)
        differing = [f for f in diff(old, self.config) if f not in RESUMABLE_FIELDS]
        if differing:
            raise IncompatibleResume(
                f"{self.run_dir} holds a run with a different config: "
                + ", ".join(f"{f} (run: {_get(old, f)!r}, now: {_get(self.config, f)!r})"
                            for f in differing)
                + "; use another controller.run_dir or the run's config"
            )  # fmt: skip

    def restore(self) -> bool:
        """Loads the newest snapshot that has a trainer checkpoint; False for a fresh run."""
        status = self.c.trainer.status()
        checkpoints = set(status.checkpoint_steps)
        # A trainer that outlived the controller and holds a snapshot's version already has
        # that checkpoint's state in memory: no restore, and no need for the checkpoint. (Not
        # at step 0: a new trainer holds its initial weights there, which a run with a
        # warm-up replaced in checkpoint 0.)
        live = int(status.step) if status.step > 0 and not status.halted else None
        for step in reversed(self.snapshots.steps()):
            try:
                loaded = self.snapshots.load(step)
                payload = json.loads(loaded["json"]) | {"_arrays": loaded.get("rollouts", {})}
            except Exception as e:
                self._warn(f"skipping unreadable snapshot {step}: {e}")
                continue
            self.check_compatible(payload["config"])
            if int(payload["version"]) == live:
                self._load(payload)
                return True
            if int(payload["version"]) not in checkpoints:
                self._warn(f"snapshot {step} needs trainer checkpoint {payload['version']}, which "
                           "is missing or incomplete; trying an older snapshot")  # fmt: skip
                continue
            try:
                self.c.trainer.restore(int(payload["version"]))
            except CorruptCheckpointError as e:
                self._warn(f"snapshot {step} needs trainer checkpoint {payload['version']}, which "
                           f"is corrupt and was removed ({e}); trying an older snapshot")  # fmt: skip
                continue
            self._load(payload)
            return True
        if self.snapshots.steps():
            raise RuntimeError(f"no usable snapshot in {self.snapshots.dir} (see warnings)")
        return False

    def _load(self, p: dict[str, Any]) -> None:
        self.step, self.version = int(p["step"]), int(p["version"])
        self.mixture.restore(p["mixture"])
        self.ledger = Ledger.from_state(p["ledger"])
        self.refs = {k: PromptRef(**v) for k, v in p["refs"].items()}
        arrays = p.get("_arrays", {})
        self.buffered = {k: groups_lib.GroupResult.from_split(v, arrays[k]) if k in arrays
                         else groups_lib.GroupResult.from_state(v)  # a snapshot from before
                         for k, v in p["buffered"].items()}  # fmt: skip
        self.ledger_segments = int(p.get("ledger_segments", 0))
        self.ledger_log.truncate(self.ledger_segments)
        if "ledger_segments" not in p:  # a snapshot from before segments: its finished groups
            old = [r for r in p["ledger"] if r["state"] in ("trained", "discarded")]
            if old:
                self.ledger_log.write(0, old)
                self.ledger_segments = 1
        # Snapshots from before a counter was dropped (e.g. warmup_ran) still load.
        known = {f.name for f in dataclasses.fields(Counters)}
        self.counters = Counters(**{k: v for k, v in p["counters"].items() if k in known})
        self.evals = {int(v): dict(m) for v, m in p["evals"].items()}

    # ------------------------------------------------------------------ weights
    def ensure_versions(self, versions: Sequence[int]) -> None:
        """Every version in ``versions`` is on the parameter server (republished from trainer
        checkpoints if the server lost it)."""
        hot, _ = self.c.param_server.list_versions()
        have = {v.version for v in hot}
        missing = sorted(set(versions) - have)
        if not missing:
            return
        current = at = self.c.trainer.status().step
        for v in missing:  # ascending: the server takes only versions newer than its newest
            self._event(f"publishing version {v} (the parameter server does not have it)")
            if v != at:
                at = self.c.trainer.restore(v)
            self.c.trainer.publish()
        if at != current:
            self.c.trainer.restore(current)

    def lease(self, versions: Iterable[int]) -> None:
        versions = list(versions)
        if not versions:
            return
        try:
            self.c.param_server.lease("controller", sorted(set(versions)))
        except Exception as e:  # a lease is an optimization of GC, not needed for correctness
            self._warn(f"leasing versions {sorted(set(versions))} failed: {e}")

    # ------------------------------------------------------------------ generation
    def _launch(self, refs: Sequence[PromptRef], version: int, *, issued_version: int = 0
                ) -> cf.Future[list[groups_lib.GroupResult]]:  # fmt: skip
        for ref in refs:
            self.ledger.start(ref.key)
        requests = [self.prompter.request(r.key, self.prompter.problem(r)) for r in refs]
        generation = self.pool.submit(version, requests)
        timing = {"launched": time.perf_counter()}

        def verify() -> list[groups_lib.GroupResult]:
            rollouts = generation.result()
            timing["generated"] = time.perf_counter()
            by_key = {r.key: r for r in refs}
            items = [(self.prompter.problem(by_key[ro.prompt_id]), ro) for ro in rollouts]
            verdicts = groups_lib.verify(self.c.verifier, self.specs, self.prompter, items)
            timing["verified"] = time.perf_counter()
            results = groups_lib.results_from(refs, rollouts, verdicts,
                                              issued_version=issued_version)  # fmt: skip
            for r in results:
                r.timing = dict(timing)
            return results

        return self._verify_pool.submit(verify)

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

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out pass@1 and pass@k (k = data.eval_samples) with the current version."""
        problems = self.prompter.datasets.held_out
        if not problems:
            return {}
        k = self.config.data.eval_samples
        t0 = time.perf_counter()
        requests = [self.prompter.request(f"eval/{p.id}", p, num_samples=k, stream="eval")
                    for p in problems if self.prompter.fits(p)]  # fmt: skip
        by_key = {f"eval/{p.id}": p for p in problems}
        rollouts = self.pool.submit(self.version, requests).result()
        items = [(by_key[ro.prompt_id], ro) for ro in rollouts]
        verdicts = groups_lib.verify(self.c.verifier, self.specs, self.prompter, items)
        correct = collections.Counter()
        for (problem, _), v in zip(items, verdicts, strict=True):
            correct[problem.id] += int(v.accepted)
        counts = [correct[by_key[r.prompt_id].id] for r in requests]
        metrics = {"eval/pass@1": mean_pass_at_k(counts, k, 1),
                   f"eval/pass@{k}": mean_pass_at_k(counts, k, k),
                   "eval/problems": float(len(counts)),
                   "time/eval": time.perf_counter() - t0}  # fmt: skip
        self.evals[self.version] = metrics
        self.counters.last_eval_version = self.version
        return metrics

    def _eval_due(self) -> bool:
        every = self.config.data.eval_every
        if self.counters.last_eval_version >= self.version:
            return False
        return self.version in (0, self.cc.num_steps) or (every > 0 and self.version % every == 0)

    # ------------------------------------------------------------------ training
    def train(self, results: Sequence[groups_lib.GroupResult]) -> dict[str, float]:
        """One update on ``results`` (all within η_a); ledger and counters follow."""
        for r in results:
            if not self.policy.accepts(self.version, r.version):
                raise AssertionError(f"group {r.key}: staleness {self.version - r.version} > η_a")
        plan = groups_lib.plan_batch(results, self.objective, group_size=self.group_size,
                                     temperature=self.config.inference.temperature)  # fmt: skip
        for key in plan.filtered:
            self.ledger.discard(key, reason="filtered")
        for key in plan.failed:
            self.ledger.discard(key, reason="verifier_failed")
        self.counters.groups_filtered += len(plan.filtered)
        self.counters.groups_verifier_failed += len(plan.failed)
        if plan.batch is None:
            # Nothing to learn from (every group filtered): the update is still taken, with the
            # full batch (zero advantages), so versions keep counting updates.
            plan = dataclasses.replace(
                groups_lib.plan_batch([r for r in results if not r.verifier_failed] or results,
                                      _no_filter(self.objective), group_size=self.group_size,
                                      temperature=self.config.inference.temperature),
                trained=[],
            )  # fmt: skip
        t0 = time.perf_counter()
        # expect_step: a trainer that restarted unseen (between two calls) refuses the update.
        metrics = (self.c.trainer.train_step(plan.batch, expect_step=self.version)
                   if plan.batch is not None else {})  # fmt: skip
        train_s = time.perf_counter() - t0
        for key in plan.trained:
            self.ledger.train(key, at_version=self.version)
        for r in results:
            self.buffered.pop(r.key, None)
            self.refs.pop(r.key, None)
        self.counters.groups_trained += len(plan.trained)
        self.version += 1
        self.step += 1
        return {f"trainer/{k}": float(v) for k, v in metrics.items()} | {"time/train": train_s}

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
            "time/generate": gen_s, "time/verify": ver_s,
            "groups/discarded_stale": float(self.counters.groups_discarded_stale),
            "groups/filtered": float(self.counters.groups_filtered),
            "groups/verifier_failed": float(self.counters.groups_verifier_failed),
        }  # fmt: skip
        scalars |= {f"verdict/{k}": float(v)
                    for k, v in groups_lib.verdict_counts(results).items() if v}  # fmt: skip
        hist = {"staleness": [float(self.version - r.version) for r in results]}
        return scalars, hist

    # ------------------------------------------------------------------ deterministic mode
    def run_deterministic(self, metrics: MetricsWriter, progress: Progress) -> None:
        # Relaunch what the snapshot says was issued or in flight, step by step.
        pending: dict[int, list[PromptRef]] = collections.defaultdict(list)
        for key in self.ledger.unfinished():
            rec = self.ledger[key]
            if rec.state is GroupState.IN_FLIGHT:
                self.ledger.requeue(key)
            pending[rec.step].append(self.refs[key])
        buffered_by_step: dict[int, list] = collections.defaultdict(list)
        for key, g in self.buffered.items():
            buffered_by_step[self.ledger[key].step].append(g)
        n = self.cc.num_steps
        ahead = range(self.step, min(n, self.step + self.policy.pipeline_depth + 1))
        todo = [*pending, *(t for t in ahead if t not in buffered_by_step)]
        needed = [self.policy.generation_version(t) for t in todo]
        self.ensure_versions([self.version, *needed])
        for t in sorted(pending):
            self._jobs[t] = self._launch(pending[t], self.policy.generation_version(t))
        while self.step < n:
            s = self.step
            t_wait0 = time.perf_counter()
            if self._eval_due():
                self._log_eval(metrics, progress)
            launch_until = min(n - 1, s + self.policy.pipeline_depth)
            for t in range(s, launch_until + 1):
                if t not in self._jobs and t not in buffered_by_step:
                    g = self.policy.generation_version(t)
                    self._jobs[t] = self._launch(self.issue(self.cc.prompts_per_step, step=t), g)
            # Versions still to generate with (a resumed step whose rollouts are buffered needs
            # none: its version may be gone from the parameter server, and that is fine).
            self.lease(self.policy.generation_version(t) for t in range(s, launch_until + 1)
                       if t not in buffered_by_step)  # fmt: skip
            if s in self._jobs:
                results = self._jobs.pop(s).result()
                for r in results:
                    self.ledger.finish(r.key, version=r.version)
                    self.buffered[r.key] = r
            else:
                results = buffered_by_step.pop(s)
            wait_s = time.perf_counter() - t_wait0
            self.counters.tokens_generated += sum(r.tokens() for r in results)
            self.snapshot()
            scalars, hist = self.step_metrics(results)
            scalars |= self.train(results) | {"time/wait": wait_s}
            self._log(metrics, progress, scalars, hist)
        if self._eval_due():
            self._log_eval(metrics, progress)
        self.snapshot()

    def _log(self, metrics: MetricsWriter, progress: Progress, scalars: dict, hist: dict) -> None:
        metrics.write(self.step, scalars, hist)
        if self.step % self.cc.log_every == 0 or self.step == self.cc.num_steps:
            progress.update(self.step, {
                "reward": scalars.get("reward/mean", float("nan")),
                "tok/s": scalars.get("throughput/tokens_per_s", float("nan")),
                "stale": max(hist.get("staleness", [0.0]), default=0.0),
                "train s": scalars.get("time/train", float("nan")),
            })  # fmt: skip

    def _log_eval(self, metrics: MetricsWriter, progress: Progress) -> None:
        m = self.evaluate()
        if m:
            metrics.write(self.version, m)
            k = self.config.data.eval_samples
            more = f", pass@{k} {m[f'eval/pass@{k}']:.3f}" if k > 1 else ""
            progress.message(
                f"eval at version {self.version}: held-out pass@1 {m['eval/pass@1']:.3f}{more} "
                f"on {int(m['eval/problems'])} problems"
            )

    # ------------------------------------------------------------------ entry
    def run(self) -> RunSummary:
        t0 = time.perf_counter()
        resumed = self.restore()
        if resumed and self.step >= self.cc.num_steps:
            return self._summary(t0, already_finished=True)
        if not resumed:
            self.c.trainer.save(wait=True)  # version 0: every snapshot has its checkpoint
        else:
            self._event(f"resuming {self.run_dir} at step {self.step} (version {self.version})")
        progress = Progress(self.cc.num_steps, start_step=self.step, stream=self._progress_stream,
                            fields={"reward": ".3f", "tok/s": ".0f", "stale": ".0f",
                                    "train s": ".2f"})  # fmt: skip
        metrics = MetricsWriter(self.run_dir, resume_after_step=self.step if resumed else None)
        try:
            if self.cc.mode == "deterministic":
                self.run_deterministic(metrics, progress)
            else:
                from rlax_tpu.controller.throughput import run_throughput

                run_throughput(self, metrics, progress)
        finally:
            progress.close()
            metrics.close()
            self.pool.close()
            self._verify_pool.shutdown(wait=False, cancel_futures=True)
        return self._summary(t0, already_finished=False)

    def drain(self) -> None:
        """Waits for this controller's generation and verification calls still running (after a
        failure), so a controller that takes over does not share the workers with them."""
        self.pool.close(wait=True)
        self._verify_pool.shutdown(wait=True, cancel_futures=True)

    def _summary(self, t0: float, *, already_finished: bool) -> RunSummary:
        return RunSummary(
            run_dir=str(self.run_dir), steps_done=self.step, version=self.version,
            already_finished=already_finished, counters=dataclasses.asdict(self.counters),
            evals=dict(self.evals), wall_s=time.perf_counter() - t0,
        )  # fmt: skip


def _no_filter(objective: Objective) -> Objective:
    spec = dataclasses.replace(objective.spec, dynamic_sampling=False)
    return dataclasses.replace(objective, spec=spec)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
