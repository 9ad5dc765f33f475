"""The controller section: the run's schedule, staleness, snapshots and transport."""

from __future__ import annotations

import math
from typing import Literal

from rlax_tpu.config.checks import (
    UNBOUNDED,
    ConfigError,
    bad,
    frozen,
    in_range,
    is_loopback,
    non_negative,
    positive,
)


@frozen
class ControllerConfig:
    # Where the run's storage lives ("gs://NAME" or a directory): every "{bucket}" in the
    # config's strings (run_dir, weights, data, persistence) is replaced by it when the config
    # is built; a config that names "{bucket}" without it set is refused.
    bucket: str = ""
    run_dir: str = "runs/local"  # snapshots, checkpoints, metrics, report (local or gs://)
    num_steps: int = 20  # updates (versions) the run makes
    prompts_per_step: int = 4  # prompt groups per update (B)
    # Bitwise reproducible steps, or continuous generation.
    mode: Literal["deterministic", "throughput"] = "deterministic"
    reload_staleness: int = 1  # η_r: workers reload every η_r-th version
    acceptance_staleness: int = 1  # η_a: max v − version(rollout); -1 = unbounded
    pipeline_depth: int = 1  # deterministic mode: steps generation runs ahead of training
    # Throughput mode: which ready groups an update takes first (freshest_first: after the
    # fewest oldest that later updates could not take before they age past η_a).
    consume_order: Literal["oldest_first", "freshest_first"] = "oldest_first"
    # Components in this process, or gRPC services.
    transport: Literal["local", "distributed"] = "local"
    # local transport: the trainer in a spawned child process (its own interpreter and XLA
    # client) instead of this one, so training does not share the GIL with generation.
    trainer_process: bool = False
    # With trainer_process: the CPU cores the child may run on (all its threads; () = any), e.g.
    # to keep it off the cores generation and the sandboxes use, as separate devices would.
    trainer_cpus: tuple[int, ...] = ()
    # distributed transport: endpoints of the components ("host:port").
    inference_endpoints: tuple[str, ...] = ()
    verifier_endpoint: str = ""  # host:port of the verifier service
    trainer_endpoint: str = ""  # host:port of the trainer
    # One per parameter-server replica (replica r at index r); the trainer publishes to all.
    param_server_endpoints: tuple[str, ...] = ()
    auth_token_file: str = ""  # token the controller presents to the components
    # The certificate the components serve with (a PEM holding it; its key is not read here):
    # the controller's channels to them use TLS and trust it. "": plain channels.
    tls_cert_file: str = ""
    rpc_timeout_s: float = 60.0  # per call; a worker unanswering this long is failed over
    # distributed transport: how long the controller waits for a trainer, parameter server,
    # verifier or inference worker that stopped answering to serve again (a restarted pod), then
    # resumes from its newest snapshot; past it the run stops with one line naming the component.
    # 0: stop at once.
    recovery_timeout_s: float = 600.0
    # After SIGTERM: if the process has not exited this long after it (closing the components
    # took longer, or a thread would not stop), every thread's stack goes to stderr and it exits
    # with the SIGTERM code anyway (the newest snapshot still says what to resume). Below the
    # GKE manifests' terminationGracePeriodSeconds (60), so the stacks are written before the
    # SIGKILL. 0: no bound.
    stop_grace_s: float = 45.0
    # JAX's persistent compilation cache in <run_dir>/jax_cache (or $JAX_COMPILATION_CACHE_DIR
    # when set: one cache for many runs), shared by the run's processes (controller, trainer,
    # inference workers): a restarted one loads its programs instead of compiling them again.
    compilation_cache: bool = True
    snapshot_keep: int = 3  # newest controller snapshots kept
    # Dynamic sampling (DAPO): while fewer than prompts_per_step groups survive the filter, a
    # step draws more prompts, generated with the step's version, at most this many extra times
    # (throughput mode: admits up to this many batches' worth of filtered groups per update);
    # then it trains on the groups kept. 0: train on what the first round keeps.
    refill_rounds: int = 3
    # Updates in a row with nothing to learn (every group filtered) before the run stops with an
    # error: the data is too hard or too easy for the model, or the verifier is broken. A
    # skipped update changes no weights and no version; its step is drawn afresh.
    max_skipped_updates: int = 10
    log_every: int = 1  # steps between progress lines (metrics are written every step)
    # Supervised warm-up on reference solutions before RL (fresh runs only; 0: none), so a tiny
    # randomly initialized model has some reward signal. The report says when it ran.
    warmup_steps: int = 0
    warmup_batch_size: int = 16  # examples per warm-up step
    warmup_learning_rate: float = 1e-3  # warm-up learning rate
    # Share of warm-up demonstrations that are a problem's known-wrong program instead of its
    # reference (unverified demonstrations): the warmed-up policy then writes the right program
    # only part of the time, and RL from the verifier's reward has to tell them apart.
    warmup_wrong_fraction: float = 0.0
    seed: int = 0  # root of every run-level RNG stream (mixture, sampling, replay)

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise bad(self, "run_dir", "must be set")
        positive(
            self,
            "num_steps",
            "prompts_per_step",
            "reload_staleness",
            "rpc_timeout_s",
            "snapshot_keep",
            "log_every",
        )
        non_negative(
            self,
            "pipeline_depth",
            "warmup_steps",
            "recovery_timeout_s",
            "stop_grace_s",
            "refill_rounds",
            "max_skipped_updates",
        )
        positive(self, "warmup_batch_size", "warmup_learning_rate")
        in_range(self, "warmup_wrong_fraction", 0.0, 1.0, hi_open=True)
        if self.acceptance_staleness < UNBOUNDED:
            raise bad(self, "acceptance_staleness", "must be >= 0, or -1 for unbounded")
        eta_a, eta_r = self.acceptance_bound, self.reload_staleness
        if eta_a < eta_r - 1:
            raise ConfigError(
                "acceptance_staleness",
                f"can never be met with reload_staleness {eta_r}: "
                f"workers hold a version for {eta_r} updates, so the trainer would need rollouts "
                f"{eta_r - 1} versions old; set acceptance_staleness >= reload_staleness - 1",
                self.acceptance_staleness,
            )
        if self.mode == "deterministic" and self.pipeline_depth + eta_r - 1 > eta_a:
            raise ConfigError(
                "pipeline_depth",
                "in deterministic mode a rollout is consumed up to "
                f"pipeline_depth + reload_staleness - 1 = {self.pipeline_depth + eta_r - 1} versions "
                f"after its weights, more than acceptance_staleness {self.acceptance_staleness}",
                self.pipeline_depth,
            )
        if self.transport == "distributed":
            for n in (
                "verifier_endpoint",
                "trainer_endpoint",
                "param_server_endpoints",
                "inference_endpoints",
            ):
                if not getattr(self, n):
                    raise bad(self, n, "required when transport is 'distributed'")
            endpoints = [
                *self.inference_endpoints,
                self.verifier_endpoint,
                self.trainer_endpoint,
                *self.param_server_endpoints,
            ]
            remote = [e for e in endpoints if not is_loopback(e.rpartition(":")[0])]
            if remote and not self.auth_token_file:
                raise ConfigError(
                    "auth_token_file",
                    f"required to reach non-loopback endpoints (e.g. {remote[0]!r})",
                    self.auth_token_file,
                )
        if self.transport == "distributed" and self.trainer_process:
            raise bad(
                self,
                "trainer_process",
                "applies to the local transport only (the "
                "distributed one reaches the trainer at trainer_endpoint)",
            )
        if self.trainer_cpus and not self.trainer_process:
            raise bad(self, "trainer_cpus", "needs trainer_process = True")
        if any(c < 0 for c in self.trainer_cpus):
            raise bad(self, "trainer_cpus", "CPU numbers must be >= 0")
        if self.transport == "distributed" and self.warmup_steps:
            raise bad(
                self,
                "warmup_steps",
                "needs the local transport (a remote trainer "
                "starts from model.weights_path); set it to 0",
            )

    @property
    def acceptance_bound(self) -> float:
        """η_a as a number (math.inf when unbounded)."""
        return math.inf if self.acceptance_staleness == UNBOUNDED else self.acceptance_staleness
