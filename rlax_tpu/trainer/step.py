"""The jitted pieces of a train step, each with explicit in/out shardings and buffer donation.

  score     (no grad) completion log-probs [b, T] (and values) of one micro-batch; replicated
            outputs, so every process can read them (π_old without alignment, π_ref, values).
  prepare   the objective's θ-independent inputs (advantages, weights) for the full batch.
  accumulate  loss and gradient of one micro-batch added into the gradient accumulator
            (donated); the training forward runs under remat (``trainer.remat_policy``),
            its layers scanned or unrolled (``trainer.scan_layers``).
  apply     clip + AdamW on the accumulated gradient (params, optimizer state and accumulator
            donated); the update is kept only if the loss, the gradient norm and the new
            params are finite, otherwise params and optimizer state come back unchanged.

Trainable parameters are a dict: ``{"model": <model params, nested dict>}`` plus
``"value_head": {"w": [E], "b": []}`` for objectives with a value model (PPO).
"""

from __future__ import annotations

import collections
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlax_tpu.algorithms import LossInputs, Objective, RolloutBatch, make_objective
from rlax_tpu.config import RunConfig, TrainerConfig
from rlax_tpu.models import UNROLLED, LayerLoop, param_shardings
from rlax_tpu.models.adapters import join, split_adapters
from rlax_tpu.models.moe import load_balancing_loss
from rlax_tpu.models.paged_attention import resolve_backend
from rlax_tpu.models.paged_cache import SequencePagedCache
from rlax_tpu.trainer.logprobs import completion_logprobs
from rlax_tpu.trainer.mesh import batch_sharding, replicated
from rlax_tpu.trainer.optimizer import make_optimizer
from rlax_tpu.trainer.precision import to_master

Params = dict[str, Any]

# Traces (so compilations) of the update, one per micro-batch shape, in this process.
TRACES: collections.Counter[str] = collections.Counter()

# Micro-batch arrays: tokens, positions [b, L]; prompt_lengths [b]; targets [b, T]; with
# routing replay, routes [b, L, layers, k].
_BATCH_NDIM = {"tokens": 2, "positions": 2, "prompt_lengths": 1, "targets": 2}
_ROUTES_NDIM = 4


def _finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.array([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """The jitted step pieces for one (model, objective, mesh, optimizer).

    Each ``*_jit`` method returns the jitted function itself (one object per StepFunctions, so
    jax's compilation cache holds), which the call methods run under ``jax.set_mesh`` and
    ``rlax_tpu.aot`` lowers on abstract inputs for a TPU topology.
    """

    graphdef: nnx.GraphDef
    objective: Objective
    mesh: Mesh
    trainable_shardings: Params
    opt_shardings: Any
    tx: optax.GradientTransformation
    # The whole model's parameter shardings (what score and publish take); with LoRA the
    # trainable "model" entry holds the adapters only and ``base_shardings`` the frozen rest.
    model_shardings: Params = dataclasses.field(default_factory=dict)
    base_shardings: Params | None = None
    loop: LayerLoop = UNROLLED  # how the training forward runs its layers
    attention: str = "dense"  # the training forward's kernel (models.NoCache)
    # The prefill-shaped π_old recompute's cache (the engine's page size and backend), or None.
    prefill: SequencePagedCache | None = None
    # A MoE's load-balancing term in the loss (algorithm.router_aux_loss_coef > 0). Off, it is
    # a metric only: its router logits ([layers, b, T, experts] float32) kept for no gradient.
    router_aux: bool = True

    def batch_shardings(self, routes: bool = False) -> dict[str, NamedSharding]:
        """The micro-batch arrays' shardings (``routes``: with the replayed experts)."""
        ndims = _BATCH_NDIM | ({"routes": _ROUTES_NDIM} if routes else {})
        return {k: batch_sharding(self.mesh, n) for k, n in ndims.items()}

    def inputs_shardings(self, inputs: LossInputs) -> LossInputs:
        rep = replicated(self.mesh)
        return jax.tree.map(lambda x: batch_sharding(self.mesh, x.ndim) if x.ndim else rep, inputs)

    # ------------------------------------------------------------------ jitted functions
    def score_jit(self, with_value_head: bool, prefill: bool = False, routes: bool = False) -> Any:
        """(model params, value head | None, micro-batch arrays, temperature) -> (log-probs
        [b, T], values [b, T] | None), replicated. ``prefill``: through the engine's paged
        attention (``self.prefill``), the π_old recompute of RLAX §5.1; ``routes``: the arrays
        carry the experts to force (routing replay)."""
        rep = replicated(self.mesh)
        if prefill and self.prefill is None:
            raise ValueError("these step functions have no prefill-shaped recompute")
        return _jit_cached(
            self,
            f"score:{with_value_head}:{prefill}:{routes}",
            lambda: jax.jit(
                partial(
                    _score,
                    self.graphdef,
                    self.mesh,
                    self.prefill if prefill else self.attention,
                    LayerLoop(scan=self.loop.scan),
                ),
                in_shardings=(
                    self.model_shardings,
                    self.trainable_shardings["value_head"] if with_value_head else None,
                    self.batch_shardings(routes),
                    rep,
                ),
                out_shardings=rep,
            ),
        )

    def prepare_jit(self) -> Any:
        """(RolloutBatch, step) -> LossInputs of the full batch, replicated."""
        return _jit_cached(
            self,
            "prepare",
            lambda: jax.jit(self.objective.prepare, out_shardings=replicated(self.mesh)),
        )

    def zeros_jit(self) -> Any:
        return _jit_cached(
            self,
            "zeros",
            lambda: jax.jit(
                lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=self.trainable_shardings
            ),
        )

    def accumulate_jit(self, inputs: LossInputs, routes: bool = False) -> Any:
        """(trainable, accumulator (donated), arrays, micro-batch LossInputs, temperature, scale,
        frozen base | None) -> (accumulator + gradient, loss, metrics). ``inputs`` (concrete or
        abstract) gives the LossInputs structure; the base is LoRA's (None without adapters);
        ``routes``: the arrays carry the experts to force (routing replay)."""
        rep = replicated(self.mesh)
        return _jit_cached(
            self,
            f"accumulate:{routes}",
            lambda: jax.jit(
                partial(
                    _accumulate,
                    self.graphdef,
                    self.objective,
                    self.mesh,
                    self.loop,
                    self.attention,
                    self.router_aux,
                ),
                in_shardings=(
                    self.trainable_shardings,
                    self.trainable_shardings,
                    self.batch_shardings(routes),
                    self.inputs_shardings(inputs),
                    rep,
                    rep,
                    self.base_shardings,
                ),
                out_shardings=(self.trainable_shardings, rep, rep),
                donate_argnums=(1,),
            ),
        )

    def apply_jit(self) -> Any:
        """(trainable, opt state, gradient, loss) -> (trainable, opt state, stats); the first
        two donated."""
        rep = replicated(self.mesh)
        return _jit_cached(
            self,
            "apply",
            lambda: jax.jit(
                partial(_apply, self.tx),
                in_shardings=(
                    self.trainable_shardings,
                    self.opt_shardings,
                    self.trainable_shardings,
                    rep,
                ),
                out_shardings=(self.trainable_shardings, self.opt_shardings, rep),
                donate_argnums=(0, 1),
            ),
        )

    def publish_jit(self, dtype: str) -> Any:
        """the whole model's params -> a copy in ``dtype`` (what the trainer pushes), same
        shardings; LoRA adapters stay float32 (the engine's adapters are)."""
        shardings = self.model_shardings
        return _jit_cached(
            self,
            f"publish:{dtype}",
            lambda: jax.jit(partial(_cast_base, dtype), out_shardings=shardings),
        )

    def adapters_jit(self) -> Any:
        """LoRA: the trained adapters -> float32 copies, what a LoRA run publishes (the engine
        keeps its base as loaded and applies these unmerged)."""
        shardings = self.trainable_shardings["model"]
        return _jit_cached(
            self,
            "publish:adapters",
            lambda: jax.jit(
                lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t),
                out_shardings=shardings,
            ),
        )

    # ------------------------------------------------------------------ calls
    def score(
        self,
        model_params: Params,
        value_head: Params | None,
        arrays: dict[str, jax.Array],
        temperature: jax.Array,
        prefill: bool = False,
    ) -> tuple[jax.Array, jax.Array | None]:
        with jax.set_mesh(self.mesh):
            return self.score_jit(value_head is not None, prefill, "routes" in arrays)(
                model_params, value_head, arrays, temperature
            )

    def prepare(self, batch: RolloutBatch, step: jax.Array) -> LossInputs:
        with jax.set_mesh(self.mesh):
            return self.prepare_jit()(batch, step=step)

    def zeros_like_trainable(self, trainable: Params) -> Params:
        return self.zeros_jit()(trainable)

    def accumulate(
        self,
        trainable: Params,
        acc: Params,
        arrays: dict[str, jax.Array],
        inputs: LossInputs,
        temperature: jax.Array,
        scale: dict[str, jax.Array],
        base: Params | None = None,
    ) -> tuple[Params, jax.Array, dict[str, jax.Array]]:
        """``scale``: {"loss": the objective's micro-batch weight, "aux": a MoE load-balancing
        term's (algorithm.router_aux_loss_coef over the micro-batches; 0 off)}."""
        with jax.set_mesh(self.mesh):
            return self.accumulate_jit(inputs, "routes" in arrays)(
                trainable, acc, arrays, inputs, temperature, scale, base
            )

    def apply(
        self, trainable: Params, opt_state: Any, grads: Params, loss: jax.Array
    ) -> tuple[Params, Any, dict[str, jax.Array]]:
        with jax.set_mesh(self.mesh):
            return self.apply_jit()(trainable, opt_state, grads, loss)

    def publish_cast(self, params: Params, dtype: str) -> Params:
        return self.publish_jit(dtype)(params)


def make_step_functions(
    config: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, model_state: nnx.State
) -> tuple[StepFunctions, Params]:
    """The step functions for ``config`` on ``mesh``, and the abstract trainable tree
    (ShapeDtypeStructs with their shardings; the model's in ``trainer.master_dtype``, so the
    optimizer state and the accumulator are too). ``model_state`` may be abstract: only shapes
    and logical-axis metadata are read."""
    objective = make_objective(config.algorithm, max_length=config.inference.max_new_tokens)
    model_shardings = nnx.to_pure_dict(param_shardings(model_state, mesh))
    shapes = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    model_shapes = shapes(nnx.to_pure_dict(model_state))
    base_shardings = None
    if config.model.lora_rank:  # the adapters train, the base stays as stored
        model_shapes = split_adapters(model_shapes)[0]
        adapter_shardings, base_shardings = split_adapters(model_shardings)
    # The trainable copy is the master copy (trainer.master_dtype; trainer/precision.py).
    trainable: Params = {"model": to_master(model_shapes, config.trainer.master_dtype)}
    shardings: Params = {"model": adapter_shardings if base_shardings else model_shardings}
    if objective.spec.advantage == "gae":
        rep = replicated(mesh)
        e = config.model.hidden_size
        trainable["value_head"] = {
            "w": jax.ShapeDtypeStruct((e,), jnp.float32),
            "b": jax.ShapeDtypeStruct((), jnp.float32),
        }
        shardings["value_head"] = {"w": rep, "b": rep}
    trainable = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), trainable, shardings
    )
    tx = make_optimizer(config.trainer, config.controller.num_steps)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, trainable),
        shardings,
        transform_non_params=lambda _: replicated(mesh),
    )
    fns = StepFunctions(
        graphdef=graphdef,
        objective=objective,
        mesh=mesh,
        trainable_shardings=shardings,
        opt_shardings=opt_shardings,
        tx=tx,
        model_shardings=model_shardings,
        base_shardings=base_shardings,
        loop=training_loop(config.trainer),
        attention=training_attention(config.trainer.attention, mesh),
        prefill=prefill_recompute(config, mesh),
        router_aux=config.algorithm.router_aux_loss_coef > 0,
    )
    return fns, trainable


def training_loop(tcfg: TrainerConfig) -> LayerLoop:
    """How the training forward runs its layers, from ``trainer.scan_layers`` / ``remat*``."""
    return LayerLoop(scan=tcfg.scan_layers, remat=tcfg.remat_policy if tcfg.remat else None)


def old_logprobs_mode(config: RunConfig, platform: str) -> str:
    """How π_old is computed on ``platform``: "replay", "prefill" (both aligned with the engine)
    or "forward" (the training forward, ``trainer.align_logprobs`` off)."""
    tcfg = config.trainer
    if not tcfg.align_logprobs:
        return "forward"
    if tcfg.old_logprobs != "auto":
        return tcfg.old_logprobs
    return "replay" if platform == "cpu" else "prefill"


def old_policy_on_published(config: RunConfig) -> bool:
    """Whether the aligned π_old must run on the published weights rather than the masters:
    when the engine's weights (publish dtype) differ from the master's cast to the compute
    dtype at use (e.g. bf16 published, float32 compute). With compute = publish dtype (the
    presets' bf16) the masters give the engine's values exactly, with no extra copy."""
    tcfg, mcfg = config.trainer, config.model
    return (
        tcfg.align_logprobs
        and tcfg.publish_dtype != tcfg.master_dtype
        and mcfg.compute_dtype != tcfg.publish_dtype
    )


def prefill_recompute(config: RunConfig, mesh: Mesh) -> SequencePagedCache | None:
    """The prefill-shaped π_old recompute's cache for ``mesh``: the engine's page size and its
    attention backend on this platform; None when π_old is computed otherwise."""
    platform = mesh.devices.flat[0].platform
    if old_logprobs_mode(config, platform) != "prefill":
        return None
    backend = resolve_backend(config.inference.backend, platform)
    return SequencePagedCache(config.inference.page_size, backend)


def training_attention(name: str, mesh: Mesh) -> str:
    """``trainer.attention`` for ``mesh``: "auto" is splash on TPU devices, dense elsewhere."""
    if name != "auto":
        return name
    return "splash" if mesh.devices.flat[0].platform == "tpu" else "dense"


def _jit_cached(owner: StepFunctions, name: str, build: Any) -> Any:
    # jax.jit caches compilations per function object; keep one object per StepFunctions.
    cache = owner.__dict__.setdefault("_jitted", {})
    if name not in cache:
        cache[name] = build()
    return cache[name]


def _score(graphdef, mesh, attention, loop, model_params, value_head, arrays, temperature):  # noqa: ANN001, ANN202
    model = nnx.merge(graphdef, model_params)
    logp, values, _ = completion_logprobs(
        model,
        arrays["tokens"],
        arrays["positions"],
        arrays["prompt_lengths"],
        arrays["targets"],
        temperature,
        loop=loop,
        mesh=mesh,
        value_head=value_head,
        attention=attention,
        routes=arrays.get("routes"),
    )
    return logp, values


def _accumulate(
    graphdef,
    objective,
    mesh,
    loop,
    attention,
    router_aux,
    trainable,
    acc,
    arrays,
    inputs,
    temperature,
    scale,
    base,
):  # noqa: ANN001, ANN202
    TRACES["accumulate"] += 1  # runs once per trace

    def loss_fn(trainable):  # noqa: ANN001, ANN202
        params = trainable["model"] if base is None else join(base, trainable["model"])
        model = nnx.merge(graphdef, params)
        logp, values, routing = completion_logprobs(
            model,
            arrays["tokens"],
            arrays["positions"],
            arrays["prompt_lengths"],
            arrays["targets"],
            temperature,
            loop=loop,
            mesh=mesh,
            value_head=trainable.get("value_head"),
            attention=attention,
            routes=arrays.get("routes"),
        )
        loss, metrics = objective.loss(logp, inputs, values=values)
        out = loss * scale["loss"]
        if routing is not None:
            # Counted over the experts the tokens went to (the replayed ones when forced).
            logits = routing.logits if router_aux else jax.lax.stop_gradient(routing.logits)
            aux = load_balancing_loss(
                logits,
                routing.experts.shape[-1],
                arrays["positions"] >= 0,
                experts=routing.experts,
            )
            metrics = metrics | {"router_aux_loss": aux}
            if router_aux:
                out = out + scale["aux"] * aux
        return out, (loss, metrics)

    grads, (loss, metrics) = jax.grad(loss_fn, has_aux=True)(trainable)
    return jax.tree.map(jnp.add, acc, grads), loss, metrics


def _cast_base(dtype: str, params: Params) -> Params:
    """``params`` in ``dtype``, but LoRA adapters, which stay float32."""
    adapters, base = split_adapters(params)
    return join(jax.tree.map(lambda x: x.astype(dtype), base), adapters)


def _apply(tx, trainable, opt_state, grads, loss):  # noqa: ANN001, ANN202
    updates, new_opt_state = tx.update(grads, opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _finite(new_trainable)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    stats = {
        "grad_norm": grad_norm,
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(new_trainable),
        "update_ok": ok,
    }
    return keep(new_trainable, trainable), keep(new_opt_state, opt_state), stats
