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
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlax_tpu import storage
from rlax_tpu.algorithms import Objective, make_objective
from rlax_tpu.config import RunConfig, diff, from_dict, to_dict
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller.components import Components
from rlax_tpu.controller.episodes import EpisodeRunner, VerifierTools
from rlax_tpu.controller.evaluation import BackgroundEvals, problems_at_once
from rlax_tpu.controller.ledger import GroupState, Ledger
from rlax_tpu.controller.pool import WorkerPool
from rlax_tpu.controller.replay import REPLAY_DIR, ReplayFeed
from rlax_tpu.controller.snapshots import LEDGER_DIR, LedgerLog, SnapshotStore
from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.controller.tasks import SpecCache
from rlax_tpu.data.evaluation import mean_pass_at_k
from rlax_tpu.data.filters import prefilter
from rlax_tpu.data.mixture import PromptMixture, PromptRef
from rlax_tpu.data.problems import Problem
from rlax_tpu.environments import environment
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.observability.metrics import MetricsWriter, read_metrics
from rlax_tpu.observability.progress import Progress
from rlax_tpu.trainer import CorruptCheckpointError
from rlax_tpu.types import Rollout

log = logging.getLogger(__name__)

# Fields a resumed run may change; any other difference is an incompatible config.
RESUMABLE_FIELDS = (
    "controller.num_steps",
    "controller.log_every",
    "controller.rpc_timeout_s",
    "controller.recovery_timeout_s",
    "controller.compilation_cache",
    "controller.snapshot_keep",
    "trainer.keep_checkpoints",
    "controller.transport",
    "controller.trainer_process",
    "controller.trainer_cpus",
    "controller.inference_endpoints",
    "controller.verifier_endpoint",
    "controller.trainer_endpoint",
    "controller.param_server_endpoints",
    "controller.auth_token_file",
    "controller.run_dir",
    "data.eval_every",
    "data.eval_share",
    "environment.schedule",  # the same samples either way (lock-step where rows are not bitwise)
    "environment.concurrency",
    "data.data_dir",
    "inference.num_workers",
    "inference.address",
    "trainer.address",
    "trainer.precompile",
    "verifiers.address",
    "verifiers.python_check",
    "param_server.address",
    "verifiers.workers",
    "verifiers.sandbox_uid",
)


class IncompatibleResume(ValueError):
    """The run directory holds a run with a different config."""


PREFILTER_FILE = "prefilter.json"
EVAL_LEASE = "evaluation"  # the parameter-server consumer an evaluation beside training leases as
EVAL_DIR = "eval"  # <run_dir>/eval/version_<v>.jsonl: every held-out sample of the eval at v


class NothingToLearn(RuntimeError):
    """Too many updates in a row had every group filtered (controller.max_skipped_updates)."""


@dataclasses.dataclass
class Counters:
    groups_trained: int = 0
    groups_discarded_stale: int = 0
    groups_filtered: int = 0
    groups_refilled: int = 0  # drawn by dynamic sampling's extra rounds
    groups_surplus: int = 0  # kept by the filter beyond prompts_per_step, discarded
    updates_skipped: int = 0  # nothing to learn: every group filtered
    groups_replayed: int = 0  # data.replay: groups drawn from the buffer and trained on
    skipped_in_a_row: int = 0
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
    # per version every worker loaded: seconds from the trainer's publish to the last load
    publish_to_serve_s: list[float] = dataclasses.field(default_factory=list)


class Controller:
    """Drives the components of ``components`` for ``config.controller.num_steps`` updates."""

    def __init__(
        self,
        config: RunConfig,
        components: Components,
        prompter: groups_lib.Prompter,
        *,
        run_dir: str | Path,
        progress_stream: Any = None,
        on_event: Callable[[str], None] | None = None,
    ):
        self.config, self.c = config, components
        cc = config.controller
        self.cc = cc
        self.run_dir = storage.path(run_dir)
        self.prompter = prompter
        self.objective: Objective = make_objective(
            config.algorithm, max_length=config.inference.max_new_tokens
        )
        self.policy = StalenessPolicy.of(cc)
        self.group_size = config.algorithm.group_size
        self.mixture = self._mixture(self._prefiltered())
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
        self.publish_to_serve: list[float] = []  # seconds, per version every worker loaded
        self.pool = WorkerPool(
            components.workers,
            retry_s=cc.rpc_timeout_s,
            on_event=self._warn,
            exclusive_jobs=cc.mode == "deterministic",
            continue_on_reload=config.inference.continue_on_reload,
        )
        self.version = 0
        self.step = 0
        self.evals: dict[int, dict[str, float]] = {}
        self.background_evals = BackgroundEvals(self.evaluate_version)
        self._evals_in_flight: list[int] = []  # a snapshot's, started again by resume_evals
        self._progress_stream = progress_stream
        self._jobs: dict[int, cf.Future] = {}  # deterministic: step -> verified groups
        self._verify_pool = cf.ThreadPoolExecutor(2, "verify")
        self._reused = 0  # the workers' prefix_tokens_reused at the last step's metrics
        self.episodes = self._episode_runner()
        self.replay = None
        if config.data.replay:
            self.replay = ReplayFeed(
                config.data,
                seed=cc.seed,
                group_size=self.group_size,
                max_staleness=cc.acceptance_bound,
                directory=self.run_dir / REPLAY_DIR,
            )

    def _episode_runner(self) -> EpisodeRunner | None:
        env = self.config.environment
        if env.name == "none":
            return None
        if self.prompter.style != "chat":
            raise ValueError(
                f"environment.name = {env.name!r}: an environment's replies are turns of the "
                "model's chat template, and this run's prompts are raw text (its tokenizer has "
                "no chat template, or data.prompt_style = 'raw')"
            )
        tools = VerifierTools(
            self.c.verifier, self.specs, style="chat", language=self.prompter.language
        )
        per_episode = env.schedule == "episode"
        return EpisodeRunner(
            environment(env.name, max_turns=env.max_turns),
            tools,
            self.prompter.tokenizer,
            env,
            pool=self.pool,
            seed=self.cc.seed,
            max_new_tokens=self.config.inference.max_new_tokens,
            stop_token_ids=self.prompter.stop_token_ids,
            per_episode=self._rows_bitwise
            if per_episode and self.cc.mode == "deterministic"
            else per_episode,
        )

    def _rows_bitwise(self) -> bool:
        """Whether every worker's engine samples a row the same in any batch (its start-up
        check): deterministic mode plays episodes one by one only then, since their turns'
        batches depend on when environment replies come back."""
        try:
            bitwise = all(w.status().rows_bitwise for w in self.c.workers)
        except Exception as e:  # noqa: BLE001 - a worker not up: the safe schedule
            bitwise, why = False, f"a worker's status could not be read ({e})"
        else:
            why = "a worker's engine is not batch-invariant on this host (rows_bitwise False)"
        if not bitwise:
            self._warn(
                "environment.schedule = 'episode' in deterministic mode needs batch-invariant "
                f"engines: {why}; this run's episodes take their turns in lock-step"
            )
        return bitwise

    def _warn(self, text: str) -> None:
        # Shown once, in the run's output; the log keeps it below the terminal's WARNING level
        # (it printed every warning twice, once on each stream).
        log.info("warning: %s", text)
        self._event(f"warning: {text}")

    # ------------------------------------------------------------------ training problems
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

    def _pass_counts(
        self,
        problems: Sequence[tuple[str, Any]],
        k: int,
        *,
        stream: str,
        answers: list[dict[str, Any]] | None = None,
        episodes: dict[str, int] | None = None,
        version: int | None = None,
    ) -> dict[str, int]:
        """Samples accepted of ``k`` per (key, problem), generated with the current version;
        each sample's text and verdict are appended to ``answers`` if given. With ``episodes``
        (a dict to fill) and an environment, each sample is also played out as an episode and
        ``episodes`` gets the episodes accepted at their last turn per key. ``version`` given:
        generated with it, uncounted in the pool's load balance (beside training)."""
        counted = version is None
        version = self.version if version is None else version
        requests = [
            self.prompter.request(f"{stream}/{key}", p, num_samples=k, stream=stream)
            for key, p in problems
        ]
        by_key = {f"{stream}/{key}": (key, p) for key, p in problems}
        if episodes is not None and self.episodes is not None:
            played = self.episodes.play(
                version, requests, {k: p for k, (_, p) in by_key.items()}, counted=counted
            )
            rollouts = played.first_turns
        else:
            played = None
            rollouts = self.pool.submit(version, requests, counted=counted).result()
        items = [(by_key[ro.prompt_id][1], ro) for ro in rollouts]
        verdicts = groups_lib.verify(self.c.verifier, self.specs, self.prompter, items)
        finals = verdicts if played is None else played.verdicts
        played = rollouts if played is None else played.episodes
        correct = {key: 0 for key, _ in problems}
        for ro, v, ep, final in zip(rollouts, verdicts, played, finals, strict=True):
            key, problem = by_key[ro.prompt_id]
            correct[key] += int(v.accepted)
            if episodes is not None:
                episodes[key] = episodes.get(key, 0) + int(final.accepted)
            if answers is not None:
                answers.append(
                    {
                        "problem": key,
                        "question": getattr(problem, "question", ""),
                        "answer": self.prompter.completion(ro),
                        "verdict": v.kind.value,
                        "detail": v.detail,
                    }
                    | (
                        {
                            "episode": self.prompter.completion(ep),
                            "episode_verdict": final.kind.value,
                            "episode_detail": final.detail,
                        }
                        if ep is not ro
                        else {}
                    )
                )
        return correct

    # ------------------------------------------------------------------ state and snapshots
    def _payload(self, replay: dict[str, Any] | None) -> dict[str, Any]:
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
            "evals_in_flight": self.background_evals.pending(),
            "done": self.step >= self.cc.num_steps,
        } | ({"replay": replay} if replay is not None else {})

    def snapshot(self) -> None:
        closed = self.ledger.take_closed()
        if closed:  # before the snapshot that counts it
            self.ledger_log.write(self.ledger_segments, closed)
            self.ledger_segments += 1
        self._split = {k: g.split_state() for k, g in self.buffered.items()}
        replay = None
        if self.replay is not None:
            self.replay.flush()
            replay = self.replay.state()
        # The state as JSON (the mixture's RNG state holds 128-bit ints msgpack cannot carry),
        # the buffered rollouts as arrays beside it.
        self.snapshots.save(
            self.step,
            {
                "json": json.dumps(self._payload(replay)),
                "rollouts": {k: a for k, (_, a) in self._split.items()},
            },
        )
        if self.replay is not None:
            self.replay.collect(self.step, self.snapshots.steps(), replay)

    def check_compatible(self, saved: dict[str, Any]) -> None:
        old = from_dict(type(self.config), saved)
        differing = [f for f in diff(old, self.config) if f not in RESUMABLE_FIELDS]
        if differing:
            raise IncompatibleResume(
                f"{self.run_dir} holds a run with a different config: "
                + ", ".join(
                    f"{f} (run: {_get(old, f)!r}, now: {_get(self.config, f)!r})" for f in differing
                )
                + "; use another controller.run_dir or the run's config"
            )

    def restore(self) -> bool:
        """Loads the newest snapshot that has a trainer checkpoint; False for a fresh run."""
        status = self.c.trainer.status()
        checkpoints = set(status.checkpoint_steps)
        # A trainer that outlived the controller and holds a snapshot's version already has
        # that checkpoint's state in memory: no restore, and no need for the checkpoint. (Not
        # at step 0: a new trainer holds its initial weights there, which a run with a
        # warm-up replaced in checkpoint 0.)
        live = int(status.step) if status.step > 0 and not status.halted else None
        for step, payload in self._snapshots_newest_first():
            if int(payload["version"]) == live:
                self._load(payload)
                return True
            if int(payload["version"]) not in checkpoints:
                self._warn(
                    f"snapshot {step} needs trainer checkpoint {payload['version']}, which "
                    "is missing or incomplete; trying an older snapshot"
                )
                continue
            try:
                self.c.trainer.restore(int(payload["version"]))
            except CorruptCheckpointError as e:
                self._warn(
                    f"snapshot {step} needs trainer checkpoint {payload['version']}, which "
                    f"is corrupt and was removed ({e}); trying an older snapshot"
                )
                continue
            self._load(payload)
            return True
        self._no_usable_snapshot()
        return False

    def newest_restorable_version(self) -> int | None:
        """The version a resume would restore (the newest snapshot whose trainer checkpoint is
        complete), read without changing anything (``restore`` also truncates the ledger and
        replay logs to that snapshot); None for a run with no snapshot."""
        checkpoints = set(self.c.trainer.status().checkpoint_steps)
        for _, payload in self._snapshots_newest_first():
            if int(payload["version"]) in checkpoints:
                return int(payload["version"])
        self._no_usable_snapshot()
        return None

    def _snapshots_newest_first(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, payload) of every readable snapshot, newest first (unreadable ones warned and
        skipped); IncompatibleResume for one of another config."""
        for step in reversed(self.snapshots.steps()):
            try:
                loaded = self.snapshots.load(step)
                payload = json.loads(loaded["json"]) | {"_arrays": loaded.get("rollouts", {})}
            except Exception as e:
                self._warn(f"skipping unreadable snapshot {step}: {e}")
                continue
            self.check_compatible(payload["config"])
            yield step, payload

    def _no_usable_snapshot(self) -> None:
        """Raises if the run has snapshots (none of them usable, see the warnings)."""
        if self.snapshots.steps():
            raise RuntimeError(f"no usable snapshot in {self.snapshots.dir} (see warnings)")

    def _load(self, p: dict[str, Any]) -> None:
        self.step, self.version = int(p["step"]), int(p["version"])
        self.mixture.restore(p["mixture"])
        self.ledger = Ledger.from_state(p["ledger"])
        self.refs = {k: PromptRef(**v) for k, v in p["refs"].items()}
        arrays = p.get("_arrays", {})
        self.buffered = {
            k: groups_lib.GroupResult.from_split(v, arrays[k])
            if k in arrays
            else groups_lib.GroupResult.from_state(v)  # a snapshot from before
            for k, v in p["buffered"].items()
        }
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
        if self.replay is not None:
            self.replay.restore(p["replay"])
        self.evals = {int(v): dict(m) for v, m in p["evals"].items()}
        self._evals_in_flight = [int(v) for v in p.get("evals_in_flight", [])]

    # ------------------------------------------------------------------ weights
    def ensure_versions(self, versions: Sequence[int]) -> None:
        """Every version in ``versions`` is on the parameter server (republished from trainer
        checkpoints if the server lost it)."""
        hot, _ = self.c.param_server.list_versions()
        have = {v.version for v in hot}
        # With the evaluations a resumed run starts again: one ascending pass (the server
        # takes only versions newer than its newest).
        missing = sorted((set(versions) | set(self._evals_in_flight)) - have)
        if not missing:
            self._restart_evals()
            return
        current = at = self.c.trainer.status().step
        try:
            for v in missing:
                self._event(f"publishing version {v} (the parameter server does not have it)")
                if v != at:
                    at = self.c.trainer.restore(v)
                self.c.trainer.publish()
        finally:  # the trainer goes on from its own version whatever failed
            if at != current:
                self.c.trainer.restore(current)
        self._restart_evals()

    def _restart_evals(self) -> None:
        """Starts the evaluations a resumed run had in flight (``resume_evals`` kept those its
        metrics did not hold), once ``ensure_versions`` republished their versions."""
        for version in self._evals_in_flight:
            self.background_evals.start(version)
        self._evals_in_flight = []

    def lease(self, versions: Iterable[int], *, consumer: str = "controller") -> None:
        """Has the parameter server keep ``versions`` for ``consumer`` (replacing its set;
        an evaluation beside training holds its version as "evaluation")."""
        versions = list(versions)
        if not versions and consumer == "controller":
            return
        try:
            self.c.param_server.lease(consumer, sorted(set(versions)))
        except Exception as e:  # a lease is an optimization of GC, not needed for correctness
            self._warn(f"leasing versions {sorted(set(versions))} failed: {e}")

    # ------------------------------------------------------------------ generation
    def _launch(
        self, refs: Sequence[PromptRef], version: int, *, issued_version: int = 0
    ) -> cf.Future[list[groups_lib.GroupResult]]:
        for ref in refs:
            self.ledger.start(ref.key)
        requests = [self.prompter.request(r.key, self.prompter.problem(r)) for r in refs]
        timing = {"launched": time.perf_counter()}
        if self.episodes is not None:  # generated and played out
            problems = {r.key: self.prompter.problem(r) for r in refs}
            generation = self.episodes.start(version, requests, problems)
        else:
            generation = self.pool.submit(version, requests)

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

        return self._verify_pool.submit(verify)

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

    # ------------------------------------------------------------------ evaluation
    def evaluate_version(self, version: int) -> dict[str, float]:
        """Held-out pass@1 and pass@k (k = data.eval_samples) of ``version``, its problems sent
        ``data.eval_share`` of the workers' slots at a time, uncounted in the pool's balance
        (it runs beside training: controller/evaluation.py); {} without held-out problems."""
        problems = self.prompter.datasets.held_out
        if not problems:
            return {}
        inf = self.config.inference
        # A worker in deterministic mode runs one job at a time: a chunk short of its slots
        # would leave the rest idle, so there every chunk fills them (eval_share is for a
        # shared engine).
        share = self.config.data.eval_share if self.cc.mode == "throughput" else 1.0
        # Its own lease, released when it ends: the controller's lease set is replaced every
        # step, and a version held for an evaluation must not wait for the next one.
        self.lease([version], consumer=EVAL_LEASE)
        try:
            return self.evaluate_problems(
                [(p.id, p) for p in problems],
                self.run_dir / EVAL_DIR / f"version_{version:06d}.jsonl",
                stream="eval",
                chunk=problems_at_once(
                    share,
                    len(self.pool.workers),
                    inf.max_concurrent_seqs,
                    self.config.data.eval_samples,
                ),
                version=version,
                quiet=True,
            )
        finally:
            self.lease([], consumer=EVAL_LEASE)

    def evaluate_problems(
        self,
        problems: Sequence[tuple[str, Problem]],
        answers_file: Path,
        *,
        stream: str,
        chunk: int = 0,
        version: int | None = None,
        quiet: bool = False,
    ) -> dict[str, float]:
        """pass@1 and pass@k (k = data.eval_samples) of ``(key, problem)`` pairs with
        ``version`` (default the current one); every sample's text and verdict go to
        ``answers_file`` (JSON lines), so a run's answers can be read and compared across
        versions. Prompts longer than the workers take are left out (``eval/problems`` counts
        the rest). ``chunk`` > 0 sends that many problems at a time and, unless ``quiet``,
        reports progress after each. With ``version`` given the requests do not count in the
        pool's load balance (an evaluation beside training)."""
        k = self.config.data.eval_samples
        t0 = time.perf_counter()
        fitting = [(key, p) for key, p in problems if self.prompter.fits(p)]
        if not fitting:
            raise ValueError(
                f"no problem to evaluate: {len(problems)} given, none within "
                f"inference.max_prompt_len = {self.config.inference.max_prompt_len} tokens"
            )
        answers: list[dict[str, Any]] = []
        counts: list[int] = []
        episodes: dict[str, int] = {}
        size = chunk if chunk > 0 else len(fitting)
        for start in range(0, len(fitting), size):
            part = fitting[start : start + size]
            counts += self._pass_counts(
                part, k, stream=stream, answers=answers, episodes=episodes, version=version
            ).values()
            if chunk > 0 and not quiet:
                done = start + len(part)
                self._event(
                    f"  {done}/{len(fitting)} problems, pass@1 so far "
                    f"{mean_pass_at_k(counts, k, 1):.3f} ({time.perf_counter() - t0:.0f} s)"
                )
        storage.write_atomic(answers_file, "".join(json.dumps(a) + "\n" for a in answers))
        played = list(episodes.values()) if self.episodes is not None else []
        return {
            "eval/pass@1": mean_pass_at_k(counts, k, 1),
            f"eval/pass@{k}": mean_pass_at_k(counts, k, k),
            "eval/problems": float(len(counts)),
            "time/eval": time.perf_counter() - t0,
        } | (
            {
                "eval/episode_pass@1": mean_pass_at_k(played, k, 1),
                f"eval/episode_pass@{k}": mean_pass_at_k(played, k, k),
            }
            if played
            else {}
        )

    def _eval_due(self) -> bool:
        every = self.config.data.eval_every
        if self.counters.last_eval_version >= self.version:
            return False
        return self.version in (0, self.cc.num_steps) or (every > 0 and self.version % every == 0)

    # ------------------------------------------------------------------ training
    def train(self, results: Sequence[groups_lib.GroupResult]) -> dict[str, float] | None:
        """One update on ``results`` (all within η_a); ledger and counters follow. None: the
        update is skipped, as nothing is left to learn from (every group filtered or failed);
        step and version stay, and the step's groups are finished all the same."""
        for r in results:
            if not self.policy.accepts(self.version, r.version):
                raise AssertionError(f"group {r.key}: staleness {self.version - r.version} > η_a")
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
        self.pool.published(self.version, float(metrics.get("time_since_publish_s", 0.0)))
        return (
            {f"trainer/{k}": float(v) for k, v in metrics.items()}
            | extra
            | {"time/train": train_s, "groups/trained": float(len(plan.trained))}
        )

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
        scalars |= {f"pool/{k}": v for k, v in self.pool.take_times().items()}
        served = self.pool.take_publish_to_serve()
        if served:  # a version from the trainer's publish to the last worker serving it
            scalars["time/publish_to_serve"] = max(served)
            self.publish_to_serve += served
        scalars |= {
            f"verdict/{k}": float(v) for k, v in groups_lib.verdict_counts(results).items() if v
        }
        if self.episodes is not None:
            turns = [_turns(ro) for r in results for ro in r.rollouts]
            scalars["episode/turns_mean"] = float(np.mean(turns)) if turns else 0.0
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
        """Tokens the workers took from kept pages since the last call (None: a worker's
        status could not be read; its count is taken again next time)."""
        try:
            total = sum(int(w.status().prefix_tokens_reused) for w in self.c.workers)
        except Exception:  # noqa: BLE001 - a metric, never a reason to stop
            return None
        last, self._reused = self._reused, total
        return float(max(0, total - last))  # a restarted worker counts from 0 again

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
            self.start_eval_if_due()
            self.log_evals(metrics, progress)
            launch_until = min(n - 1, s + self.policy.pipeline_depth)
            for t in range(s, launch_until + 1):
                if t not in self._jobs and t not in buffered_by_step:
                    g = self.policy.generation_version(t)
                    self._jobs[t] = self._launch(self.issue(self.cc.prompts_per_step, step=t), g)
            # Versions still to generate with (a resumed step whose rollouts are buffered needs
            # none: its version may be gone from the parameter server, and that is fine).
            self.lease(
                self.policy.generation_version(t)
                for t in range(s, launch_until + 1)
                if t not in buffered_by_step
            )
            if s in self._jobs:
                results = self._refill(s, self._collect(self._jobs.pop(s)))
            else:  # a snapshot's, refilled before it was taken
                results = buffered_by_step.pop(s)
            wait_s = time.perf_counter() - t_wait0
            self.counters.tokens_generated += sum(r.tokens() for r in results)
            self.snapshot()
            scalars, hist = self.step_metrics(results)
            trained = self.train(results)
            if trained is None:  # skipped: step s is drawn again
                continue
            self._log(metrics, progress, scalars | trained | {"time/wait": wait_s}, hist)
        self.start_eval_if_due()
        self.log_evals(metrics, progress, wait=True)
        self.snapshot()

    def _log(self, metrics: MetricsWriter, progress: Progress, scalars: dict, hist: dict) -> None:
        metrics.write(self.step, scalars, hist)
        if self.step % self.cc.log_every == 0 or self.step == self.cc.num_steps:
            progress.update(
                self.step,
                {
                    "reward": scalars.get("reward/mean", float("nan")),
                    "tok/s": scalars.get("throughput/tokens_per_s", float("nan")),
                    "stale": max(hist.get("staleness", [0.0]), default=0.0),
                    "train s": scalars.get("time/train", float("nan")),
                },
            )

    def start_eval_if_due(self) -> None:
        """Starts the evaluation of the current version if one is due; it runs beside
        training (``log_evals`` takes it when done)."""
        if self._eval_due():
            self.counters.last_eval_version = self.version
            self.background_evals.start(self.version)
            if self.config.inference.continue_on_reload:
                # A newer job reloads a worker under running ones (partial rollouts): an
                # evaluation beside training would sample from weights other than its own.
                self.background_evals.wait()

    def log_evals(self, metrics: MetricsWriter, progress: Progress, *, wait: bool = False) -> None:
        """Logs the evaluations that finished, each against its version; ``wait``: every one
        started, after it finished."""
        for version, m in self.background_evals.take_done(wait=wait):
            if not m:
                continue
            self.evals[version] = m
            metrics.write(version, m)
            k = self.config.data.eval_samples
            more = f", pass@{k} {m[f'eval/pass@{k}']:.3f}" if k > 1 else ""
            if "eval/episode_pass@1" in m:
                more += f", after the episode {m['eval/episode_pass@1']:.3f}"
            progress.message(
                f"eval at version {version}: held-out pass@1 {m['eval/pass@1']:.3f}{more} "
                f"on {int(m['eval/problems'])} problems"
            )

    def resume_evals(self) -> None:
        """Evaluations a killed run had in flight: a result its metrics hold is taken as it
        was logged; the others are started again by the first ``ensure_versions`` (which
        republishes their versions with the run's own, in one ascending pass); one whose
        version is neither on the parameter server nor in a trainer checkpoint is named lost."""
        if not self._evals_in_flight:
            return
        logged = {
            r["step"]: r["scalars"]
            for r in read_metrics(self.run_dir)
            if any(k.startswith("eval/pass@") for k in r["scalars"])
        }
        hot, _ = self.c.param_server.list_versions()
        available = {v.version for v in hot} | set(self.c.trainer.status().checkpoint_steps)
        again = []
        for version in self._evals_in_flight:
            if version in logged:
                self.evals[version] = logged[version]
            elif version in available:
                again.append(version)
            else:
                self._warn(
                    f"the evaluation of version {version} is lost (no trainer checkpoint or "
                    "parameter-server copy of it is left)"
                )
        self._evals_in_flight = again

    # ------------------------------------------------------------------ entry
    def run(self) -> RunSummary:
        t0 = time.perf_counter()
        resumed = self.restore()
        if resumed and self.step >= self.cc.num_steps:
            return self._summary(t0, already_finished=True)
        if not resumed:
            self.c.trainer.save(wait=True)  # version 0: every snapshot has its checkpoint
            if self.config.data.prefilter_samples and self._prefiltered() is None:
                self.prefilter()
        else:
            self._event(f"resuming {self.run_dir} at step {self.step} (version {self.version})")
        progress = Progress(
            self.cc.num_steps,
            start_step=self.step,
            stream=self._progress_stream,
            fields={"reward": ".3f", "tok/s": ".0f", "stale": ".0f", "train s": ".2f"},
        )
        if resumed:
            self.resume_evals()  # before the writer marks the resume (it reads the metrics)
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
            self.close()
        return self._summary(t0, already_finished=False)

    def close(self) -> None:
        """Stops the controller's own threads (generation and verification jobs)."""
        self.pool.close()
        self.background_evals.close()
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        if self.episodes is not None:
            self.episodes.close()

    def drain(self) -> None:
        """Waits for this controller's generation and verification calls still running (after a
        failure), so a controller that takes over does not share the workers with them."""
        self.pool.close(wait=True)
        self.background_evals.close(wait=True)
        self._verify_pool.shutdown(wait=True, cancel_futures=True)

    def _summary(self, t0: float, *, already_finished: bool) -> RunSummary:
        return RunSummary(
            run_dir=str(self.run_dir),
            steps_done=self.step,
            version=self.version,
            already_finished=already_finished,
            counters=dataclasses.asdict(self.counters),
            evals=dict(self.evals),
            wall_s=time.perf_counter() - t0,
            publish_to_serve_s=list(self.publish_to_serve),
        )


def _evaluating(requests: Sequence[Request]) -> bool:
    """Requests of a held-out evaluation (its stream's keys), which run beside training."""
    return any(r.prompt_id.startswith(f"{EVAL_DIR}/") for r in requests)


def _turns(rollout: Rollout) -> int:
    """The model turns of an episode: runs of sampled tokens."""
    if rollout.sampled is None:
        return 1
    s = np.asarray(rollout.sampled, bool)
    return int(s[:1].sum() + (s[1:] & ~s[:-1]).sum())


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
