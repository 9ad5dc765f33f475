"""The step loop: the only active part of the system (DESIGN.md §3-4).

Deterministic mode. Training step s consumes the prompt batch P_s (the next
``prompts_per_step`` prompts of the mixture, drawn in step order) generated with version
g(s) = η_r·⌊max(0, s − d)/η_r⌋ (``StalenessPolicy.generation_version``). At the top of step s the
trainer holds version s, so every step t ≤ s + d has its version and is launched: generation of
steps s+1 … s+d overlaps the training of step s. Per-group sampling seeds, a batch-invariant engine
and a deterministic trainer make the run bitwise reproducible for a fixed topology.

Throughput mode (``throughput.py``) shares the state, snapshots and logging below.

The Controller is assembled from one module per concern: ``state.py`` (snapshots, resume, the
versions kept), ``generation.py`` (issuing, launching and collecting groups), ``evaluation.py``
(held-out evaluations beside training), ``consumption.py`` (the update and the step's metrics);
this module holds the deterministic schedule, the run's entry and its end.

Snapshots are written before each update (a weight-reload boundary): version, mixture state,
ledger, the verified groups waiting for the trainer (their rollouts), counters. Resume takes the
newest snapshot whose version has a complete trainer checkpoint, restores both, republishes any
version the parameter server lost, and re-issues exactly the groups the ledger says are unfinished.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlax_tpu import storage
from rlax_tpu.algorithms import Objective, make_objective
from rlax_tpu.config import RunConfig
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller.components import Components
from rlax_tpu.controller.consumption import ConsumptionMixin, NothingToLearn
from rlax_tpu.controller.episodes import EpisodeRunner, VerifierTools
from rlax_tpu.controller.evaluation import (
    EVAL_DIR,
    EVAL_LEASE,
    BackgroundEvals,
    EvaluationMixin,
)
from rlax_tpu.controller.generation import PREFILTER_FILE, GenerationMixin
from rlax_tpu.controller.ledger import GroupState, Ledger
from rlax_tpu.controller.pool import WorkerPool
from rlax_tpu.controller.publishes import Publishes
from rlax_tpu.controller.replay import REPLAY_DIR, ReplayFeed
from rlax_tpu.controller.snapshots import LEDGER_DIR, LedgerLog, SnapshotStore
from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.controller.state import RESUMABLE_FIELDS, Counters, IncompatibleResume, StateMixin
from rlax_tpu.controller.tasks import SpecCache
from rlax_tpu.data.mixture import PromptRef
from rlax_tpu.environments import environment
from rlax_tpu.observability.metrics import MetricsWriter
from rlax_tpu.observability.progress import Progress

log = logging.getLogger(__name__)

__all__ = [  # what other modules import from here
    "EVAL_DIR",
    "EVAL_LEASE",
    "PREFILTER_FILE",
    "RESUMABLE_FIELDS",
    "Controller",
    "Counters",
    "IncompatibleResume",
    "NothingToLearn",
    "RunSummary",
]


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
    # bytes of weights the workers received over the network, and their loads (this process's)
    wire_bytes: float = 0.0
    weight_loads: int = 0


class Controller(StateMixin, GenerationMixin, EvaluationMixin, ConsumptionMixin):
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
        self.step_samples: list[dict] = []  # the last update's (observability.samples_per_step)
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
        self.weights_received = [0.0, 0]  # bytes of weights over the network, in so many loads
        self.pool = WorkerPool(
            components.workers,
            retry_s=cc.rpc_timeout_s,
            on_event=self._warn,
            exclusive_jobs=cc.mode == "deterministic",
            continue_on_reload=config.inference.continue_on_reload,
            overlap=cc.mode == "throughput"
            and config.inference.overlap_reload
            and not config.inference.continue_on_reload,
        )
        # Versions the trainer still pushes (trainer.publish_in_flight): loaded once published.
        self.publishes = Publishes(
            components.trainer,
            self.pool,
            in_flight=config.trainer.publish_in_flight > 0,
            # The parameter server relays a version while it is pushed (service.CutThrough) to
            # workers that relay (components.relay_sources).
            stage_early=self._stage_early if config.relays_while_pushed else None,
        )
        self.version = 0
        self.step = 0
        self.evals: dict[int, dict[str, float]] = {}
        self.background_evals = BackgroundEvals(self.evaluate_version)
        self._evals_in_flight: list[int] = []  # a snapshot's, started again by resume_evals
        self._progress_stream = progress_stream
        self._jobs: dict[int, cf.Future] = {}  # deterministic: step -> verified groups
        self._verify_pool = cf.ThreadPoolExecutor(2, "verify")
        self._reused: dict[int, int] = {}  # worker -> prefix_tokens_reused at last metrics
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

    def _stage_early(self, version: int) -> int | None:
        """The reload point before ``version``, if ``version`` is one (workers holding it
        fetch ``version`` as its push starts), else None."""
        if version == 0 or self.policy.reload_point(version) != version:
            return None
        return self.policy.reload_point(version - 1)

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
        try:  # at start-up, not at the first later turn, after the run began generating
            self.prompter.tokenizer.turn_ids("?", after=())
        except ValueError as e:
            raise ValueError(
                f"environment.name = {env.name!r}: the model's chat template cannot carry an "
                f"episode's turns ({e}); environments need a template that renders earlier turns "
                "unchanged"
            ) from None
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
        if self.config.inference.span_groups >= 2:  # rounding then depends on the batch
            bitwise, why = False, "inference.span_groups >= 2 groups rows by the batch's spans"
        else:
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
        if self.step_samples:
            metrics.table(self.step, "samples", self.step_samples)
            self.step_samples = []
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
        metrics = MetricsWriter(
            self.run_dir,
            resume_after_step=self.step if resumed else None,
            sinks=self.config.observability.sinks,
            config=self.config,
        )
        try:
            self.profile_workers()  # a trace of the first update (of this start) begins here
            if self.cc.mode == "deterministic":
                self.run_deterministic(metrics, progress)
            else:
                from rlax_tpu.controller.throughput import run_throughput

                run_throughput(self, metrics, progress)
            self.publishes.wait(self.version)  # the run's last version is published too
        finally:
            progress.close()
            metrics.close()
            self.close()
        return self._summary(t0, already_finished=False)

    def close(self) -> None:
        """Stops the controller's own threads (generation and verification jobs)."""
        if self.episodes is not None:  # first: its threads submit to the pool
            self.episodes.close()
        self.publishes.close()
        self.pool.close()
        self.background_evals.close()
        self._verify_pool.shutdown(wait=False, cancel_futures=True)

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
            wire_bytes=self.weights_received[0],
            weight_loads=self.weights_received[1],
        )
