"""The trainer's programs, described abstractly for ahead-of-time compilation
(``python -m rlax_tpu.aot``): the same jitted functions a :class:`Trainer` runs
(``step.StepFunctions``; the engine's programs for the aligned π_old replay, or the
prefill-shaped recompute through the engine's paged attention), on the mesh the
config builds over a topology's devices, at the largest micro-batch the config allows.

What each program holds beside it (``AbstractProgram.held``, per device): the resident state
(the trainable master parameters, the optimizer state, the frozen reference in the storage
dtype when the objective has a KL or reference term) less its own arguments, and the transients
``Trainer.train_step`` keeps at that moment (every micro-batch's arrays from π_old until the
update is applied, the full batch's objective inputs from ``prepare`` on; freed before publish).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_tpu import models
from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.config import RunConfig
from rlax_tpu.config.run import handoff_versions
from rlax_tpu.models.adapters import join, split_adapters
from rlax_tpu.models.aot import (
    AbstractProgram,
    abstract,
    device_bytes,
    engine_programs,
    spec,
)
from rlax_tpu.trainer import mesh as mesh_lib
from rlax_tpu.trainer.batching import possible_shapes
from rlax_tpu.trainer.precision import to_master
from rlax_tpu.trainer.step import (
    make_step_functions,
    old_logprobs_mode,
    old_policy_on_published,
)


def micro_batch_shape(config: RunConfig) -> tuple[int, int, int]:
    """(rows b, token columns L, completion columns T) of the largest micro-batch."""
    tcfg, icfg = config.trainer, config.inference
    rows = min(tcfg.micro_batch_size, config.rollouts_per_step)
    shapes = possible_shapes(
        bucket=tcfg.length_bucket,
        max_prompt_len=icfg.max_prompt_len,
        max_new_tokens=icfg.max_new_tokens,
    )
    length = max(length for length, _ in shapes)
    width = max(width for _, width in shapes)
    return rows, length, width


def abstract_programs(config: RunConfig, devices: Sequence[jax.Device]) -> list[AbstractProgram]:
    """The trainer's programs for ``config`` on ``devices``. Raises ConfigError when the mesh
    does not fit the devices and BatchShapeError when a micro-batch does not split over it."""
    mesh = mesh_lib.build_mesh(config.mesh, devices)
    b, length, width = micro_batch_shape(config)
    mesh_lib.check_rows_fit(b, mesh, f"a micro-batch (trainer.micro_batch_size = {b})")
    graphdef, state = nnx.split(models.abstract_model(config.model))
    fns, trainable = make_step_functions(config, mesh, graphdef, state)
    spec_ = fns.objective.spec
    rep = mesh_lib.replicated(mesh)
    opt = abstract(jax.eval_shape(fns.tx.init, trainable), fns.opt_shardings)
    # LoRA: the trainable copy is the adapters; the frozen base (storage dtype) is an input of
    # every forward, and the reference is the base with a copy of the initial adapters.
    base = None
    if fns.base_shardings is not None:
        base = abstract(split_adapters(nnx.to_pure_dict(state))[1], fns.base_shardings)
    whole = (lambda adapters: join(base, adapters)) if base is not None else (lambda m: m)
    # The frozen reference stays in the storage dtype; the trainable copy is the master.
    ref_dtype = "float32" if base is not None else config.model.param_dtype
    ref = to_master(trainable["model"], ref_dtype) if spec_.needs_reference else None
    i32, f32 = jnp.int32, jnp.float32
    arrays = {
        "tokens": spec((b, length), i32, mesh_lib.batch_sharding(mesh, 2)),
        "positions": spec((b, length), i32, mesh_lib.batch_sharding(mesh, 2)),
        "prompt_lengths": spec((b,), i32, mesh_lib.batch_sharding(mesh, 1)),
        "targets": spec((b, width), i32, mesh_lib.batch_sharding(mesh, 2)),
    }
    scalar = spec((), f32, rep)
    big = config.rollouts_per_step
    per_token = spec((big, width), f32, rep)
    rollout = RolloutBatch(
        logp_old=per_token,
        logp_behaviour=per_token,
        mask=per_token,
        rewards=spec((big,), f32, rep),
        logp_ref=per_token if spec_.needs_reference else None,
        values=per_token if spec_.advantage == "gae" else None,
    )
    step = spec((), i32, rep)
    full = jax.eval_shape(lambda r, s: fns.objective.prepare(r, step=s), rollout, step)
    full_abs = abstract(full, rep)  # prepare's output is replicated
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((b, *x.shape[1:]) if x.ndim else (), x.dtype), full
    )
    micro = abstract(micro, fns.inputs_shardings(micro))
    where = f"micro-batch [{b} rows, {length} tokens, {width} completion]"

    # What train_step keeps on device beside each program (trainer/trainer.py): the resident
    # state, and until the update is applied every micro-batch's arrays and the full batch's
    # objective inputs (freed before publish).
    n_micro = -(-big // b)
    sizes = {
        f"trainable ({config.trainer.master_dtype} master)": device_bytes(trainable),
        "optimizer state": device_bytes(opt),
        f"reference ({ref_dtype})": device_bytes(ref) if ref is not None else 0,
        f"frozen base ({config.model.param_dtype})": device_bytes(base) if base else 0,
        "micro-batch arrays": device_bytes(arrays),
        "objective inputs": device_bytes(full_abs),
    }
    trainable_k, opt_k, ref_k, base_k, arrays_k, inputs_k = sizes
    resident = {k: sizes[k] for k in (trainable_k, opt_k, ref_k, base_k) if sizes[k]}
    kept = handoff_versions(config)
    # A published version's bytes (LoRA: the adapters in float32), for the copies held beside.
    version = device_bytes(
        trainable["model"]
        if base is not None
        else to_master(trainable["model"], config.trainer.publish_dtype)
    )
    if kept:  # the published versions the workers of this process take from its devices
        resident[f"published versions kept for the workers (x{kept})"] = kept * version
    if config.trainer.publish_in_flight:  # a version's cast held until its push is done
        resident["a published version still being pushed"] = version
    base_args = (base_k,) if base is not None else ()

    def held(*args: str, batches: int = 0, inputs: bool = False) -> dict[str, int]:
        """Resident state not among ``args``, ``batches`` micro-batches' arrays (the others of
        the step), the objective inputs."""
        out = {k: v for k, v in resident.items() if k not in args}
        if batches > 0:
            out[f"micro-batch arrays x{batches}"] = batches * sizes[arrays_k]
        if inputs:
            out[inputs_k] = sizes[inputs_k]
        return out

    programs: list[AbstractProgram] = [
        AbstractProgram(
            "trainer.accumulate",
            fns.accumulate_jit(micro),
            (trainable, trainable, arrays, micro, scalar, {"loss": scalar, "aux": scalar}, base),
            mesh=mesh,
            held=held(trainable_k, *base_args, batches=n_micro - 1, inputs=True),
            note=f"loss + gradient of one {where}",
        ),
        AbstractProgram(
            "trainer.apply",
            fns.apply_jit(),
            (trainable, opt, trainable, scalar),
            mesh=mesh,
            held=held(trainable_k, opt_k, batches=n_micro, inputs=True),
            note="clip + AdamW update",
            runs_layers=False,
        ),
        AbstractProgram(
            "trainer.prepare",
            fns.prepare_jit(),
            (rollout,),
            dict(step=step),
            mesh=mesh,
            held=held(batches=n_micro),
            note=f"objective inputs of {big} rollouts",
            runs_layers=False,
        ),
    ]
    scored = f"log-probs of one {where}"
    mode = old_logprobs_mode(config, devices[0].platform)
    # π_old on the published cast where the masters would not give the engine's values.
    on_published = old_policy_on_published(config)
    old_dtype = config.trainer.publish_dtype if on_published else config.trainer.master_dtype
    if base is None:
        old_model = to_master(trainable["model"], old_dtype)
    else:  # the base as stored (or its publish cast), the adapters float32 as the engine's
        base_old = base if not on_published else to_master(base, old_dtype)
        old_model = join(base_old, to_master(trainable["model"], "float32"))
    # The masters (and the base), unless the cast is used.
    old_args = () if on_published else (trainable_k, *base_args)
    if mode == "replay":
        shape = models.ReplayShape.of_engine(
            config.inference, config.model, platform=devices[0].platform
        )
        programs += engine_programs(
            "trainer.replay",
            config.model,
            shape,
            graphdef=graphdef,
            state=to_master(abstract(state, models.param_shardings(state, mesh)), old_dtype),
            cache_sharding=rep,
            io_sharding=rep,
            mesh=mesh,
            held=held(*old_args, batches=n_micro),
            copy_held=held(batches=n_micro),
            note="π_old replay through the engine's programs; cache replicated on the mesh",
        )
    else:
        prefill = mode == "prefill"
        programs.append(
            AbstractProgram(
                "trainer.prefill_old" if prefill else "trainer.score_old",
                fns.score_jit(False, prefill),
                (old_model, None, arrays, scalar),
                mesh=mesh,
                held=held(*old_args, batches=n_micro - 1),
                note=f"π_old {scored}"
                + (
                    f" through the engine's {fns.prefill.backend} paged attention (prefill-shaped)"
                    if prefill
                    else ""
                ),
            )
        )
    if ref is not None:
        programs.append(
            AbstractProgram(
                "trainer.score_ref",
                fns.score_jit(False),
                (whole(ref), None, arrays, scalar),
                mesh=mesh,
                held=held(ref_k, *base_args, batches=n_micro - 1),
                note=f"π_ref {scored}",
            )
        )
    if "value_head" in trainable:
        programs.append(
            AbstractProgram(
                "trainer.values",
                fns.score_jit(True),
                (whole(trainable["model"]), trainable["value_head"], arrays, scalar),
                mesh=mesh,
                held=held(trainable_k, *base_args, batches=n_micro - 1),
                note=f"values of one {where}",
            )
        )
    if base is None:
        published = jax.eval_shape(
            fns.publish_jit(config.trainer.publish_dtype), trainable["model"]
        )
        publish = AbstractProgram(
            "trainer.publish",
            fns.publish_jit(config.trainer.publish_dtype),
            (trainable["model"],),
            mesh=mesh,
            held=held(trainable_k),
            note=f"params cast to {config.trainer.publish_dtype} for the parameter server",
            runs_layers=False,
        )
    else:
        published = jax.eval_shape(fns.adapters_jit(), trainable["model"])
        publish = AbstractProgram(
            "trainer.publish",
            fns.adapters_jit(),
            (trainable["model"],),
            mesh=mesh,
            held=held(trainable_k),
            note="LoRA adapters (float32) for the parameter server",
            runs_layers=False,
        )
    size = f": {_gib(tree_bytes(published))} a version"
    programs.append(dataclasses.replace(publish, note=publish.note + size))
    return programs


def tree_bytes(tree: object) -> int:
    """Bytes of a whole tree of arrays or ShapeDtypeStructs (all devices' parts together)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
