"""The Trainer: a passive component that turns a TrainBatch into the next weight version.

    trainer = Trainer(config, sink=param_server_client)   # any object with push(params, version)
    metrics = trainer.train_step(batch)                   # one optimizer update: v -> v + 1
    trainer.publish(); trainer.save(); trainer.restore(); trainer.status()

One ``train_step``:
  1. plan micro-batches (rows sorted by length, padded per micro-batch; ``batching``);
  2. π_old: with ``trainer.align_logprobs`` the engine's computation is replayed
     (``trainer.old_logprobs`` "replay", ``models.scoring.replay_logprobs``: chunked prefill +
     token-by-token decode, the engine's shapes) or recomputed as one prefill per micro-batch
     through the engine's paged attention ("prefill", RLAX §5.1), on the weights as the engine
     sees them (``step.old_policy_on_published``), else one full-sequence
     forward; |log π_old − log μ| is reported either way;
     π_ref (frozen reference params, same shardings, no optimizer state) and values (PPO's value
     head) come from forwards of the same micro-batches;
  3. the objective's full-batch inputs (``Objective.prepare``), then per micro-batch loss and
     gradient accumulated on device (remat'd training forward), then one clipped AdamW update;
  4. if the loss, gradient or new params are not finite the update is dropped: ``nan_policy``
     'skip' reports it (metrics ``skipped`` = 1, version unchanged), 'stop' raises
     NonFiniteLossError and refuses further steps until ``restore``; NaN weights are never
     published;
  5. version v + 1 is pushed to the sink (``trainer.publish_dtype``) and, every
     ``checkpoint_every`` steps, saved asynchronously with Orbax.

Multi-host: every process of a ``jax.distributed`` job builds the Trainer and calls
``train_step`` with the same batch (the mesh spans all processes' devices); host arrays enter as
global arrays and every value read back to the host is replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu import models, multihost, storage
from rlax_tpu.algorithms import LossInputs, RolloutBatch
from rlax_tpu.config import InferenceConfig, ModelConfig, RunConfig
from rlax_tpu.models.adapters import join, split_adapters
from rlax_tpu.models.scoring import ReplayShape, replay_logprobs
from rlax_tpu.observability.profiles import PROFILER
from rlax_tpu.trainer import mesh as mesh_lib
from rlax_tpu.trainer import step as step_lib
from rlax_tpu.trainer.batching import (
    MicroBatch,
    micro_arrays,
    plan_micro_batches,
    possible_shapes,
)
from rlax_tpu.trainer.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    abstract_like,
    signature_with,
)
from rlax_tpu.trainer.optimizer import make_schedule
from rlax_tpu.trainer.precision import check_master_dtype, to_master
from rlax_tpu.trainer.publishing import BackgroundPushes, PublishError
from rlax_tpu.types import TrainBatch

log = logging.getLogger(__name__)


class WeightSink(Protocol):
    """Where new versions go (the parameter-server client has this method)."""

    def push(self, params: Any, version: int) -> Any:
        """params: nested dict of jax arrays (the model's parameter tree)."""
        ...


class TrainerStateLost(RuntimeError):
    """The trainer's step is not the one its caller expects: it restarted (and holds its
    initial weights or a checkpoint) under a caller that did not restore it."""


def parts_short_of_quorum(reached: Sequence[Collection[int]], quorum: int) -> str:
    """Why a version published in parts (part p reached replicas ``reached[p]``) is whole on
    fewer than ``quorum`` replicas, or "" if it is not. A replica commits the version only once
    every part reached it: with replicas going up and down between the processes' pushes each
    part can make its quorum while the version is whole on fewer replicas, or on none."""
    whole = set.intersection(*(set(r) for r in reached)) if reached else set()
    if len(whole) >= quorum:
        return ""
    return (
        f"is whole on replicas {sorted(whole)} only (the parts reached "
        f"{[sorted(r) for r in reached]}; quorum {quorum})"
    )


class TrainerHalted(RuntimeError):
    """The trainer stopped (nan_policy 'stop') and takes no steps until restored."""


class NonFiniteLossError(TrainerHalted):
    """The step's loss, gradient or updated params were not finite (nan_policy 'stop')."""


@dataclasses.dataclass(frozen=True)
class TrainerStatus:
    step: int  # optimizer updates applied = the version of the current params
    published_version: int  # newest version pushed to the sink (-1: none)
    mesh: dict[str, int]
    process_count: int
    halted: str  # why the trainer stopped, "" if it did not
    checkpoint_steps: tuple[int, ...]
    last_metrics: dict[str, float]
    # Pushes in the background (trainer.publish_in_flight): the versions in flight, and why the
    # oldest failed one failed ("" none): the next step and wait_published raise it.
    publishing: tuple[int, ...] = ()
    publish_failed: str = ""


def engine_replay_shape(cfg: InferenceConfig, model: ModelConfig) -> ReplayShape:
    """The shapes of the inference engine's programs (``models.scoring``), which the aligned
    replay runs: the same definition the engine builds itself from."""
    return ReplayShape.of_engine(cfg, model)


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        *,
        sink: WeightSink | None = None,
        devices: list[jax.Device] | None = None,
        checkpoint_dir: str | Path | None = None,
        model: models.Transformer | None = None,
    ):
        """Builds the mesh, loads (or takes) the model sharded by the logical rules, a frozen
        reference copy if the objective needs one, the optimizer and the checkpointer."""
        self.config = config
        tcfg = config.trainer
        self.mesh = mesh_lib.build_mesh(config.mesh, devices)
        if model is None:
            model = models.load_model(config.model, mesh=self.mesh)
        self._graphdef, state = nnx.split(model)
        self._fns, abstract = step_lib.make_step_functions(config, self.mesh, self._graphdef, state)
        self.objective = self._fns.objective
        spec = self.objective.spec
        self.sink = sink
        shardings = self._fns.trainable_shardings
        params = jax.device_put(nnx.to_pure_dict(state), self._fns.model_shardings)
        if tcfg.master_dtype != "float32":
            check_master_dtype(
                params, master_dtype=tcfg.master_dtype, learning_rate=tcfg.learning_rate
            )
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings["model"])
        master = jax.jit(
            partial(to_master, dtype=tcfg.master_dtype), out_shardings=shardings["model"]
        )
        # The reference stays frozen (in model.param_dtype) while the policy's buffers are
        # donated step after step; the policy is the master copy (trainer/precision.py).
        # LoRA: the adapters train; the base is frozen in the storage dtype, with no optimizer
        # state, and the reference is the base (adapters with B = 0 add nothing).
        self._base: dict[str, Any] | None = None
        if config.model.lora_rank:
            adapters, self._base = split_adapters(params)
            self._ref_params = join(self._base, copy(adapters)) if spec.needs_reference else None
            trainable: dict[str, Any] = {"model": master(adapters)}
        else:
            self._ref_params = copy(params) if spec.needs_reference else None
            trainable = {"model": master(params)}
        if "value_head" in abstract:
            trainable["value_head"] = jax.tree.map(
                lambda x: mesh_lib.put(np.zeros(x.shape, x.dtype), x.sharding),
                abstract["value_head"],
            )
        self.schedule = make_schedule(tcfg, config.controller.num_steps)
        self._opt_state = jax.jit(self._fns.tx.init, out_shardings=self._fns.opt_shardings)(
            trainable
        )
        self._trainable = trainable
        self._step = 0
        self._rng = jax.random.key_data(jax.random.PRNGKey(config.controller.seed))
        self._published = -1
        in_flight = tcfg.publish_in_flight
        self._pushes = BackgroundPushes(in_flight) if in_flight else None
        self._publishes = 0  # publish calls, alike on every process: names their exchanges
        self._halted = ""
        self._precompiled = False
        self._last_metrics: dict[str, float] = {}
        # The last batch's advantage per row, [B] float32: its mean over the row's completion
        # tokens (the samples a run records show it beside the reward).
        self.last_row_advantages = np.zeros(0, np.float32)
        self.replay_shape = engine_replay_shape(config.inference, config.model)
        # "replay", "prefill" or "forward" (trainer.align_logprobs / trainer.old_logprobs).
        self.old_logprobs = step_lib.old_logprobs_mode(config, self.mesh.devices.flat[0].platform)
        directory = (
            checkpoint_dir
            or tcfg.checkpoint_dir
            or storage.join(config.controller.run_dir, "trainer")
        )
        self._checkpointer = Checkpointer(
            storage.path(directory),
            keep=tcfg.keep_checkpoints,
            signature=signature_with(config.model, value_head=spec.advantage == "gae"),
        )

    # ------------------------------------------------------------------ properties
    @property
    def step(self) -> int:
        """Optimizer updates applied so far = the version of the current params."""
        return self._step

    @property
    def version(self) -> int:
        return self._step

    def params(self) -> dict[str, Any]:
        """The current model parameters (nested dict of sharded jax arrays; do not keep across
        steps: the next step donates them)."""
        return self._model_params()

    def _model_params(self) -> dict[str, Any]:
        """The whole model's parameters: the trainable ones, with LoRA's frozen base."""
        if self._base is None:
            return self._trainable["model"]
        return join(self._base, self._trainable["model"])

    def model(self) -> models.Transformer:
        """The current policy as an nnx module (a view of ``params()``)."""
        return nnx.merge(self._graphdef, self._model_params())

    # ------------------------------------------------------------------ train step
    def train_step(self, batch: TrainBatch, *, expect_step: int | None = None) -> dict[str, float]:
        """One optimizer update on ``batch``; returns the step's metrics (floats).

        ``expect_step``: the step the caller believes this trainer is at; any other raises
        TrainerStateLost (a restarted trainer must not take the next update from where it
        restarted). Raises BatchShapeError / ValueError for a batch that does not fit the mesh,
        the micro-batching or the objective; NonFiniteLossError under nan_policy 'stop'.

        An update in observability.profile_steps (by the step it makes) is traced on every
        process of the trainer (observability/profiles.py).
        """
        step = self._step + 1
        if step not in self.config.observability.profile_steps:
            return self._train_step(batch, expect_step)
        run_dir = self.config.controller.run_dir
        PROFILER.start(run_dir, step, "trainer")
        try:
            return self._train_step(batch, expect_step)
        finally:
            PROFILER.stop(run_dir, step, "trainer")

    def _train_step(self, batch: TrainBatch, expect_step: int | None) -> dict[str, float]:
        if expect_step is not None and expect_step != self._step:
            raise TrainerStateLost(
                f"the trainer is at step {self._step}, not {expect_step}: it restarted since the "
                "controller last restored it"
            )
        if self._halted:
            raise TrainerHalted(f"the trainer is halted ({self._halted}); restore a checkpoint")
        if self._pushes is not None:  # before the update, which would run past that version
            self._pushes.check()
        t_start = time.perf_counter()
        tcfg, spec = self.config.trainer, self.objective.spec
        if batch.group_size != spec.group_size:
            raise ValueError(
                f"TrainBatch.group_size {batch.group_size} differs from algorithm.group_size "
                f"{spec.group_size}"
            )
        plan = plan_micro_batches(
            batch,
            micro_batch_size=tcfg.micro_batch_size,
            whole_groups=spec.kind != "eq3",
            bucket=tcfg.length_bucket,
            row_multiple=mesh_lib.batch_shards(self.mesh),
        )
        width = max(m.width for m in plan.micro_batches)
        completion = np.asarray(batch.completion_lengths)
        mask = np.zeros((batch.num_rows, width), np.float32)
        have = min(width, np.shape(batch.behaviour_logprobs)[1])
        mask[:, :have] = batch.completion_mask()[:, :have]  # environment tokens are 0
        behaviour = np.zeros((batch.num_rows, width), np.float32)
        behaviour[:, :have] = np.asarray(batch.behaviour_logprobs, np.float32)[:, :have]
        behaviour = np.where(mask > 0, behaviour, 0.0)
        temperature = mesh_lib.put(np.float32(batch.temperature), mesh_lib.replicated(self.mesh))
        replay = tcfg.routing_replay if batch.routes is not None else "off"
        if replay != tcfg.routing_replay:
            _warn_no_routes(tcfg.routing_replay)
        if batch.routes is not None:
            self._check_routes(np.asarray(batch.routes))
        micro = [
            (mb, self._put_arrays(micro_arrays(batch, mb, routes=replay != "off")))
            for mb in plan.micro_batches
        ]
        unrouted = [(mb, _without_routes(arrays)) for mb, arrays in micro]

        t_old = time.perf_counter()
        old_params = self._model_params()
        if step_lib.old_policy_on_published(self.config):
            old_params = self._fns.publish_cast(old_params, tcfg.publish_dtype)
        if self.old_logprobs == "replay":
            logp_old = replay_logprobs(
                nnx.merge(self._graphdef, old_params),
                batch.tokens,
                batch.prompt_lengths,
                completion,
                shape=self.replay_shape,
                temperature=batch.temperature,
                width=width,
            )
        else:
            logp_old = self._score_all(
                old_params,
                None,
                unrouted if replay == "off" else micro,
                width,
                temperature,
                prefill=self.old_logprobs == "prefill",
            )[0]
        del old_params
        t_old = time.perf_counter() - t_old
        logp_ref = values = None
        if spec.needs_reference:
            logp_ref = self._score_all(self._ref_params, None, unrouted, width, temperature)[0]
        if "value_head" in self._trainable:
            values = self._score_all(
                self._model_params(), self._trainable["value_head"], unrouted, width, temperature
            )[1]
        rollout = RolloutBatch(
            logp_old=logp_old * mask,
            logp_behaviour=behaviour,
            mask=mask,
            rewards=np.asarray(batch.rewards, np.float32),
            logp_ref=None if logp_ref is None else logp_ref * mask,
            values=None if values is None else values * mask,
        )
        self.objective.validate(rollout)
        rep = mesh_lib.replicated(self.mesh)
        inputs = self._fns.prepare(
            jax.tree.map(lambda x: mesh_lib.put(x, rep), rollout),
            mesh_lib.put(np.int32(self._step), rep),
        )
        inputs_host = jax.tree.map(np.array, inputs)  # a copy: a view would keep the device buffers
        tokens = np.maximum(mask.sum(axis=1), 1.0)
        self.last_row_advantages = (
            (np.asarray(inputs_host.advantages, np.float32) * mask).sum(axis=1) / tokens
        ).astype(np.float32)

        t_update = time.perf_counter()
        scale = 1.0 if spec.kind == "eq3" else 1.0 / plan.num_micro_batches
        # A MoE's load-balancing term: the mean of the micro-batches' (eq3 objectives weight
        # their micro-batches by the batch's own normalizer, which the term does not share).
        aux = self.config.algorithm.router_aux_loss_coef / plan.num_micro_batches
        scale_arr = {
            "loss": mesh_lib.put(np.float32(scale), rep),
            "aux": mesh_lib.put(np.float32(aux), rep),
        }
        if tcfg.precompile and not self._precompiled:
            template = micro[0] if replay == "both" else unrouted[0]
            self._precompile(
                template, _slice_inputs(inputs_host, micro[0][0]), temperature, scale_arr
            )
        acc = self._fns.zeros_like_trainable(self._trainable)
        loss_total, parts = 0.0, []
        for mb, arrays in micro if replay == "both" else unrouted:
            mb_inputs = self._put_inputs(_slice_inputs(inputs_host, mb))
            acc, loss, mb_metrics = self._fns.accumulate(
                self._trainable, acc, arrays, mb_inputs, temperature, scale_arr, self._base
            )
            loss_total += float(loss) * scale
            parts.append((float(mask[mb.rows].sum()), jax.tree.map(float, mb_metrics)))
        new_trainable, new_opt, stats = self._fns.apply(
            self._trainable, self._opt_state, acc, mesh_lib.put(np.float32(loss_total), rep)
        )
        self._trainable, self._opt_state = new_trainable, new_opt
        # The step's device arrays go before publish casts a copy of the weights (the AOT
        # check counts them up to the update: trainer/aot.py).
        del micro, unrouted, inputs, acc, arrays, mb_inputs
        ok = bool(stats["update_ok"])
        t_update = time.perf_counter() - t_update

        diff = np.abs(logp_old - behaviour)[mask > 0]
        versions = np.asarray(batch.versions)[np.asarray(batch.versions) >= 0]
        metrics = _combine(parts, scale) | {
            "loss": loss_total,
            "update_compilations": float(step_lib.TRACES["accumulate"]),
            "grad_norm": float(stats["grad_norm"]),
            "update_norm": float(stats["update_norm"]),
            "param_norm": float(stats["param_norm"]),
            "learning_rate": float(self.schedule(self._step)),
            "logp_old_behaviour_diff_mean": float(diff.mean()) if diff.size else 0.0,
            "logp_old_behaviour_diff_p95": float(np.percentile(diff, 95)) if diff.size else 0.0,
            "logp_old_behaviour_diff_max": float(diff.max()) if diff.size else 0.0,
            "aligned_logprobs": float(tcfg.align_logprobs),
            "logp_old_prefill": float(self.old_logprobs == "prefill"),
            "routing_replay": {"off": 0.0, "old": 1.0, "both": 2.0}[replay],
            "padding_fraction": plan.padding_fraction,
            "padding_fraction_unsorted": plan.padding_fraction_unsorted,
            "micro_batches": float(plan.num_micro_batches),
            "completion_tokens": float(mask.sum()),
            "sequence_tokens": float(np.sum(batch.prompt_lengths) + completion.sum()),
            "staleness_max": float(self._step - versions.min()) if versions.size else 0.0,
            "time_logp_old_s": t_old,
            "time_update_s": t_update,
            "skipped": float(not ok),
        }
        if not ok:
            reason = (
                f"non-finite update at step {self._step} (loss {loss_total}, grad norm "
                f"{metrics['grad_norm']}); params left at version {self._step}"
            )
            metrics |= {"step": float(self._step), "time_step_s": time.perf_counter() - t_start}
            self._last_metrics = metrics
            if tcfg.nan_policy == "stop":
                self._halted = reason
                raise NonFiniteLossError(reason)
            return metrics
        self._step += 1
        self._rng = jax.random.key_data(
            jax.random.fold_in(jax.random.wrap_key_data(self._rng), self._step)
        )
        t_publish = time.perf_counter()
        if self.sink is not None:
            self.publish(background=self._pushes is not None)
            # The controller lets workers load the version once wait_published says so.
            metrics["publish_pending"] = float(self._pushes is not None)
        if self._step % tcfg.checkpoint_every == 0:
            self.save()
        metrics |= {
            "step": float(self._step),
            "time_step_s": time.perf_counter() - t_start,
            # The publish's start (the cast, the push) is where publish-to-serve times from.
            "time_since_publish_s": time.perf_counter() - t_publish,
        }
        self._last_metrics = metrics
        return metrics

    def _precompile(
        self,
        template: tuple[MicroBatch, dict[str, jax.Array]],
        inputs: LossInputs,
        temperature: jax.Array,
        scale: jax.Array,
    ) -> None:
        """Runs the update once on zeros of every micro-batch shape (trainer.precompile), which
        compiles each; ``template`` and ``inputs`` (one micro-batch's) give rows and dtypes."""
        icfg = self.config.inference
        shapes = possible_shapes(
            bucket=self.config.trainer.length_bucket,
            max_prompt_len=icfg.max_prompt_len,
            max_new_tokens=icfg.max_new_tokens,
        )
        t0 = time.perf_counter()
        log.info("trainer: compiling the update for %d micro-batch shapes", len(shapes))
        _, arrays = template
        for length, width in shapes:
            zeros = {
                k: _zeros_like(x, length if k in ("tokens", "positions", "routes") else width)
                for k, x in arrays.items()
            }
            zero_inputs = jax.tree.map(lambda x, w=width: _zeros_like(x, w), inputs)
            acc = self._fns.zeros_like_trainable(self._trainable)
            out = self._fns.accumulate(
                self._trainable,
                acc,
                self._put_arrays(zeros),
                self._put_inputs(zero_inputs),
                temperature,
                scale,
                self._base,
            )
            jax.block_until_ready(out)
        self._precompiled = True
        log.info("trainer: compiled %d shapes in %.1f s", len(shapes), time.perf_counter() - t0)

    def _check_routes(self, routes: np.ndarray) -> None:
        """ValueError unless ``routes`` [B, L, layers, k] fit the model: its layers, its k,
        expert ids below its experts (or -1)."""
        cfg = self.config.model
        want = (cfg.num_layers, cfg.experts_per_token)
        if routes.shape[2:] != want or not cfg.num_experts:
            raise ValueError(
                f"TrainBatch.routes give {routes.shape[2:]} (layers, experts a token) per "
                f"position; the model has {want}" + ("" if cfg.num_experts else " and no experts")
            )
        if routes.size and (routes.min() < -1 or routes.max() >= cfg.num_experts):
            raise ValueError(
                f"TrainBatch.routes hold expert ids in [{routes.min()}, {routes.max()}]; the "
                f"model has experts 0..{cfg.num_experts - 1} (-1: none recorded)"
            )

    def _put_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {
            k: mesh_lib.put(v, mesh_lib.batch_sharding(self.mesh, v.ndim))
            for k, v in arrays.items()
        }

    def _put_inputs(self, inputs: LossInputs) -> LossInputs:
        rep = mesh_lib.replicated(self.mesh)
        return jax.tree.map(
            lambda x: mesh_lib.put(
                x, mesh_lib.batch_sharding(self.mesh, x.ndim) if x.ndim else rep
            ),
            inputs,
        )

    def _score_all(
        self,
        model_params: Any,
        value_head: Any,
        micro: list[tuple[MicroBatch, Any]],
        width: int,
        temperature: jax.Array,
        prefill: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Completion log-probs (and values) [B, width] of every row, by micro-batch (``prefill``:
        through the engine's paged attention, the π_old recompute)."""
        rows = sum(len(mb.rows) for mb, _ in micro)
        logp = np.zeros((rows, width), np.float32)
        values = np.zeros((rows, width), np.float32) if value_head is not None else None
        for mb, arrays in micro:
            lp, v = self._fns.score(model_params, value_head, arrays, temperature, prefill)
            logp[mb.rows, : mb.width] = np.asarray(lp)
            if values is not None:
                values[mb.rows, : mb.width] = np.asarray(v)
        return logp, values

    # ------------------------------------------------------------------ publish / checkpoints
    def publish(self, *, background: bool = False) -> int:
        """Pushes the current params as version ``step`` (in ``trainer.publish_dtype``; with
        LoRA, the adapters alone in float32: workers keep the base they loaded). With
        ``background`` (``trainer.publish_in_flight`` > 0) the push runs on a thread and this
        returns once it started (publishing.py); ``wait_published`` waits for it. Otherwise it
        returns once the version is published, after any pushes still in flight."""
        if self.sink is None:
            raise RuntimeError("this trainer has no weight sink to publish to")
        if self._base is None:
            params = self._fns.publish_cast(self._model_params(), self.config.trainer.publish_dtype)
        else:
            params = self._fns.adapters_jit()(self._trainable["model"])
        version, tag = self._step, f"publish/{self._publishes}"
        self._publishes += 1
        if background and self._pushes is not None:
            self._pushes.start(version, lambda: self._push(params, version, tag))
            return version
        if self._pushes is not None:  # this push stands for any of these that failed
            self._pushes.wait(version, forget=True)
        self._push(params, version, tag)
        return version

    def _push(self, params: Any, version: int, tag: str) -> None:
        if jax.process_count() == 1:
            self.sink.push(params, version)
            self._published = max(self._published, version)
            return
        # Each process sends its own part: the version is whole once every process is done.
        # They agree on the host whether all did (a process whose push failed would never reach
        # a device barrier the others wait in), and all fail alike if one did not. The exchange
        # is named by the publish (every process's n-th), so one on a push's thread never
        # meets another exchange of the step's.
        failure = None
        try:
            self.sink.push(params, version)
        except Exception as e:  # noqa: BLE001 - named to every process below
            failure = e
        said = multihost.exchange(
            (
                None if failure is None else f"{type(failure).__name__}: {failure}",
                getattr(self.sink, "last_replicas", None),
            ),
            key=tag,
        )
        failed = {p: why for p, (why, _) in enumerate(said) if why is not None}
        if failure is not None:
            raise failure
        if failed:
            raise PublishError(
                f"version {version} was not published: "
                + "; ".join(f"process {p}: {why}" for p, why in failed.items())
            )
        reached = [replicas for _, replicas in said]
        if all(r is not None for r in reached):
            why = parts_short_of_quorum(reached, getattr(self.sink, "quorum", 1))
            if why:
                raise PublishError(f"version {version} {why}")
        self._published = max(self._published, version)

    def wait_published(self, version: int, timeout_s: float | None = None) -> int:
        """Blocks until ``version`` (and every older one) is no longer being pushed; raises
        PublishError if one was not published. Returns the newest version published."""
        if self._pushes is not None:
            self._pushes.wait(version, timeout_s)
        return self._published

    def _state(self) -> dict[str, Any]:
        rep = mesh_lib.replicated(self.mesh)
        return {
            "params": self._trainable,
            "opt_state": self._opt_state,
            "step": mesh_lib.put(np.int32(self._step), rep),
            "rng": mesh_lib.put(np.asarray(self._rng), rep),
        }

    def save(self, *, wait: bool = False) -> int:
        """Starts an asynchronous checkpoint of the current state; returns its step."""
        self._checkpointer.save(self._step, self._state())
        if wait:
            self._checkpointer.wait()
        return self._step

    def wait_for_checkpoints(self) -> None:
        self._checkpointer.wait()

    def restore(self, step: int | None = None, *, directory: str | Path | None = None) -> int:
        """Loads checkpoint ``step`` (default: the newest complete one) onto this trainer's mesh,
        from this trainer's checkpoint directory or from ``directory`` (another run's).

        Raises NoCheckpointError, CheckpointMismatchError for another model's checkpoint, or
        CorruptCheckpointError for a damaged one (which is then deleted: the caller falls back
        to an older checkpoint, and this step can be saved again).
        """
        failed = self._pushes.drain() if self._pushes is not None else {}
        abstract = abstract_like(self._state())
        if directory is None:
            try:
                step, state = self._checkpointer.restore(step, abstract)
            except CorruptCheckpointError as e:
                # Out of the way: a resumed run saves this step again later.
                self._checkpointer.delete(e.step)
                raise
        else:
            other = Checkpointer(
                storage.path(directory),
                keep=self.config.trainer.keep_checkpoints,
                signature=self._checkpointer.signature,
            )
            try:
                step, state = other.restore(step, abstract)
            finally:
                other.close()
        for version, error in failed.items():  # the restored run publishes them again
            log.warning("version %d was not published before the restore: %s", version, error)
        self._trainable, self._opt_state = state["params"], state["opt_state"]
        self._step = int(state["step"])
        self._rng = np.asarray(state["rng"])
        self._halted = ""
        return self._step

    def status(self) -> TrainerStatus:
        return TrainerStatus(
            step=self._step,
            published_version=self._published,
            mesh=dict(self.mesh.shape),
            process_count=jax.process_count(),
            halted=self._halted,
            checkpoint_steps=tuple(self._checkpointer.steps()),
            last_metrics=dict(self._last_metrics),
            publishing=tuple(self._pushes.pending()) if self._pushes is not None else (),
            publish_failed=self._pushes.failure() if self._pushes is not None else "",
        )

    def close(self) -> None:
        if self._pushes is not None:
            for version, error in self._pushes.drain().items():
                log.warning("version %d was not published: %s", version, error)
        self._checkpointer.close()


@functools.cache  # once per process and mode
def _warn_no_routes(mode: str) -> None:
    log.warning(
        "trainer.routing_replay = %r but the batch carries no routes (its workers recorded "
        "none): the trainer's forwards route by their own router",
        mode,
    )


def _without_routes(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A micro-batch's arrays for a forward that routes by its own router."""
    return {k: v for k, v in arrays.items() if k != "routes"}


def _zeros_like(x: Any, columns: int) -> np.ndarray:
    """Zeros of x's dtype and rows, with ``columns`` columns if x is 2-D or more."""
    return np.zeros((*x.shape[:1], columns, *x.shape[2:])[: x.ndim], x.dtype)


def _slice_inputs(inputs: LossInputs, mb: MicroBatch) -> LossInputs:
    def one(x: np.ndarray) -> np.ndarray:
        if x.ndim == 2:
            return x[mb.rows, : mb.width]
        return x[mb.rows] if x.ndim == 1 else x

    return jax.tree.map(one, inputs)


# Terms of the loss, each micro-batch's a part of the batch's: combined as the loss is.
_ADDITIVE = ("objective", "policy_objective", "policy_loss", "kl_loss", "value_loss")


def _combine(parts: list[tuple[float, dict[str, float]]], scale: float = 1.0) -> dict[str, float]:
    """Micro-batch metrics -> step metrics: *_max max, *_min min, tokens summed, loss terms
    (_ADDITIVE) summed times ``scale`` as the loss is (Eq. 3 objectives normalize over the whole
    batch; tb / online_dpo average micro-batches), others token-weighted means (p95s become the
    token-weighted mean of micro-batch p95s)."""
    out: dict[str, float] = {}
    total = sum(w for w, _ in parts) or 1.0
    for name in parts[0][1]:
        vals = [m[name] for _, m in parts]
        if name in _ADDITIVE:
            out[name] = sum(vals) * scale
        elif name.endswith("_max"):
            out[name] = max(vals)
        elif name.endswith("_min"):
            out[name] = min(vals)
        elif name == "tokens":
            out[name] = sum(vals)
        else:
            out[name] = sum(w * m[name] for w, m in parts) / total
    return out
