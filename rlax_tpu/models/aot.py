"""Programs described abstractly, for ahead-of-time compilation on a target without running it.

Each component lists the jitted functions it runs, with ShapeDtypeStructs (shapes, dtypes and
shardings over the target's devices) in place of arrays: :class:`AbstractProgram`.
``python -m rlax_tpu.aot`` lowers and compiles them for a TPU topology and reports their memory
and cost (one that does not compile for the target is reported by name). Nothing here allocates
device memory or reads weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, Sharding

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.paged_cache import PagedKVCache
from rlax_tpu.models.programs import copy_program, decode_program, idle_sampling, prefill_program
from rlax_tpu.models.scoring import ReplayShape


@dataclasses.dataclass(frozen=True)
class AbstractProgram:
    """``fn`` (a ``jax.jit`` object) with abstract ``args``/``kwargs``; lowered under
    ``jax.set_mesh(mesh)`` when a mesh is given (activation constraints read it).

    ``held``: per device, what stays allocated while the program runs without being one of its
    arguments, by name: the component's resident state (the optimizer state during the gradient
    step, say) and the transients of the moment it runs in (the other micro-batches of the
    step, a second copy of the weights during a reload). The program's peak is its own
    footprint plus their sum, ``resident_bytes``.

    ``runs_layers``: the program runs the model's layers (a loop when ``trainer.scan_layers``,
    whose cost XLA counts once: aot extrapolates it from unrolled compiles); False for programs
    whose cost does not grow with depth in a loop (the optimizer update, a cast).
    """

    name: str
    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Mesh | None = None
    held: dict[str, int] = dataclasses.field(default_factory=dict)
    note: str = ""
    runs_layers: bool = True

    @property
    def resident_bytes(self) -> int:
        return sum(self.held.values())


def abstract(tree: Any, sharding: Sharding | Any) -> Any:
    """``tree``'s leaves as ShapeDtypeStructs with ``sharding``: one Sharding for every leaf, or
    a tree of Shardings shaped like ``tree``."""
    if isinstance(sharding, Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding
    )


def spec(shape: tuple[int, ...], dtype: Any, sharding: Sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def device_bytes(tree: Any) -> int:
    """The most bytes any one device holds of ``tree`` (ShapeDtypeStructs with shardings)."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        nbytes = math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
        for device in leaf.sharding.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values(), default=0)


def engine_programs(
    prefix: str,
    model_cfg: ModelConfig,
    shape: ReplayShape,
    *,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache_sharding: Sharding,
    io_sharding: Sharding,
    mesh: Mesh | None = None,
    held: dict[str, int] | None = None,
    note: str = "",
    copy_held: dict[str, int] | None = None,
) -> list[AbstractProgram]:
    """The engine's decode, prefill and page-copy programs (``models.programs``) at ``shape``,
    on abstract ``state`` (the model's parameters with their shardings), the paged cache with
    ``cache_sharding`` and small host-fed arrays with ``io_sharding``. ``held`` is what stays
    allocated beside decode and prefill, ``copy_held`` beside the page copy (which takes no
    weights); default: ``held``."""
    cache: PagedKVCache = jax.eval_shape(lambda: shape.make_cache(model_cfg))
    cache = abstract(cache, cache_sharding)
    n, m = shape.slots, shape.pages_per_seq
    i32 = jnp.int32
    sampling = abstract(idle_sampling(n), io_sharding)
    held = dict(held or {})
    common = dict(mesh=mesh, held=held, note=note)
    programs = [
        AbstractProgram(
            f"{prefix}.decode",
            decode_program,
            (
                state,
                cache,
                spec((n,), i32, io_sharding),
                spec((n,), i32, io_sharding),
                spec((n, m), i32, io_sharding),
                sampling,
            ),
            dict(graphdef=graphdef),
            **common,
        ),
    ]
    if shape.prefill_rows:
        r, c = shape.prefill_rows, shape.prefill_len
        programs.append(
            AbstractProgram(
                f"{prefix}.prefill",
                prefill_program,
                (
                    state,
                    cache,
                    spec((r, c), i32, io_sharding),
                    spec((r, c), i32, io_sharding),
                    spec((r, m), i32, io_sharding),
                ),
                dict(graphdef=graphdef),
                **common,
            )
        )
    # One sequence's worth of copy-on-write pages (copy_pages pads to a power of two).
    k = 1 << (m - 1).bit_length()
    programs.append(
        AbstractProgram(
            f"{prefix}.copy_pages",
            copy_program,
            (cache, spec((k,), i32, io_sharding), spec((k,), i32, io_sharding)),
            **(common | dict(held=held if copy_held is None else dict(copy_held))),
        )
    )
    return programs
