"""Logical axis names -> mesh axes: the one table that decides how the model is partitioned.

Every parameter carries logical axis names (``out_sharding`` metadata on its ``nnx.Param``);
activations are constrained with the same names. Parallelism changes by changing the mesh shape
in ``MeshConfig`` (data, fsdp, expert, tensor), never the model code.

The mesh uses ``AxisType.Auto`` axes (``jax.make_mesh`` defaults to Explicit): parameters and a
few activations are annotated and XLA's sharding propagation partitions the rest, so the model's
einsums need no per-op output shardings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rlax_tpu.config import ConfigError, MeshConfig
from rlax_tpu.config.mesh import AXES as MESH_AXES

# Logical axis -> mesh axis (or axes, or None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    # Activations: the batch is split over data, fsdp and expert (expert parallelism is carved
    # out of data parallelism: models/moe.py).
    "batch": ("data", "fsdp", "expert"),
    "length": None,
    "act_embed": None,
    "vocab": "tensor",
    # Parameters' model dimension: ZeRO-3 style sharding (over expert too, but in an expert's
    # own weights, whose experts axis takes it).
    "embed": ("fsdp", "expert"),
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "lora_rank": None,  # a LoRA adapter's rank: small, replicated
    "experts": "expert",  # a MoE layer's experts
}

LogicalAxes = Sequence[str | None]


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over ``devices`` (default: all) shaped by
    ``mesh_cfg``.

    Over several slices (``mesh_cfg.slices``) each slice's devices form their own mesh, laid out
    over its interconnect, and the slices' meshes are stacked along data: a device's fsdp,
    expert and tensor neighbours are always in its own slice."""
    devices = list(devices if devices is not None else jax.devices())
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if mesh_cfg.slices == 1:
        shape = mesh_cfg.shape(len(devices))
        return Mesh(_grid(shape, devices), MESH_AXES, axis_types=axis_types)
    mesh_cfg.global_shape(len(devices))  # the count splits into slices, each slice's shape fits
    shape = mesh_cfg.shape(len(devices) // mesh_cfg.slices)
    grids = [_grid(shape, group) for group in slice_groups(devices, mesh_cfg.slices)]
    return Mesh(np.concatenate(grids, axis=0), MESH_AXES, axis_types=axis_types)


def _grid(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    """``devices`` laid out as a (data, fsdp, expert, tensor) array over their interconnect. On a TPU
    slice each mesh axis must be a product of some of the slice's physical dimensions (JAX's
    mesh_utils assigns whole torus axes, e.g. tensor 8 does not fit v5p:4x4x4, 4 or 16 do);
    that is said as a config error naming the axes, not JAX's NotImplementedError."""
    try:
        return jax.make_mesh(shape, MESH_AXES, devices=devices).devices
    except NotImplementedError as e:
        coords = [getattr(d, "coords", None) for d in devices]
        dims = "x".join(str(len({c[i] for c in coords})) for i in range(3)) if all(coords) else "?"
        raise ConfigError(
            "mesh",
            f"(data, fsdp, expert, tensor) = {shape} does not map onto the slice's physical axes "
            f"{dims}: each mesh axis must be a product of some of them (each axis of a TPU "
            "slice's torus goes whole to one mesh axis)",
        ) from e


def slice_groups(devices: Sequence[jax.Device], slices: int) -> list[list[jax.Device]]:
    """``devices`` split into ``slices`` equal slices, in slice order: by the TPU runtime's
    ``slice_index`` where the devices are of several slices (a multislice job; compile-only
    topologies with num_slices too), else by process (processes split evenly, in order: several
    processes of one slice emulate the slices, as on CPU, whose devices all say slice 0), else
    in order (one process emulating them all)."""
    if len({getattr(d, "slice_index", None) for d in devices} - {None}) > 1:
        key = lambda d: d.slice_index  # noqa: E731
    else:
        processes = sorted({d.process_index for d in devices})
        if len(processes) > 1:
            if len(processes) % slices:
                raise ValueError(
                    f"{len(processes)} processes do not split evenly into {slices} slices"
                )
            rank = {p: i * slices // len(processes) for i, p in enumerate(processes)}
            key = lambda d: rank[d.process_index]  # noqa: E731
        else:
            order = {d.id: i * slices // len(devices) for i, d in enumerate(devices)}
            key = lambda d: order[d.id]  # noqa: E731
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    sizes = {len(g) for g in groups.values()}
    if len(groups) != slices or len(sizes) != 1:
        raise ValueError(
            f"the devices form {len(groups)} slices of sizes {sorted(sizes)}, not {slices} "
            "equal ones"
        )
    return [groups[k] for k in sorted(groups)]


def logical_to_spec(
    axes: LogicalAxes, shape: Sequence[int] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """The PartitionSpec for logical ``axes``.

    With ``shape`` and ``mesh``, a dimension that the mapped mesh axes do not divide evenly is
    replicated instead (e.g. 3 KV heads on tensor=2), so any mesh shape works for any model.
    """
    spec: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for i, name in enumerate(axes):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES")
        target = LOGICAL_AXIS_RULES.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if a not in used)  # an axis shards one dim only
        if mesh is not None:
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
        if shape is not None and mesh is not None and mesh_axes:
            size = int(np.prod([mesh.shape[a] for a in mesh_axes]))
            if shape[i] % size:
                mesh_axes = ()
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def logical_sharding(axes: LogicalAxes, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def param_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """A pytree like ``state`` (concrete or abstract) holding each parameter's NamedSharding."""

    def one(var: nnx.Variable) -> nnx.Variable:
        axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        return var.replace(logical_sharding(axes, var.shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move ``model``'s parameters onto ``mesh`` as the rules table says (in place; returns it)."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Constrain an activation's sharding by logical axes; a no-op outside ``jax.set_mesh``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def manual_axes(mesh: jax.sharding.AbstractMesh) -> set[str]:
    """The axes an enclosing shard_map made manual (e.g. the paged cache's data shards): already
    split, so a kernel's own shard_map must not split them again."""
    return set(getattr(mesh, "manual_axes", ()))


def kernel_axes(
    mesh: jax.sharding.AbstractMesh,
    rows: int,
    heads: int,
    kv_heads: int,
    heads_fit: Callable[[int], bool] = lambda tp: True,
) -> tuple[str | tuple[str, ...] | None, str | None]:
    """(mesh axes of the rows, of the heads) for a Pallas kernel in shard_map (Mosaic kernels are
    not partitioned automatically): rows over the batch axes that divide them, heads over the
    tensor axis when it divides the q and the KV heads (each device keeps whole GQA groups) and
    ``heads_fit(tp)`` agrees; None where they stay whole."""
    names = mesh.axis_names
    manual = manual_axes(mesh)
    batch = tuple(
        a
        for a in LOGICAL_AXIS_RULES["batch"]
        if a in names and mesh.shape[a] > 1 and a not in manual
    )
    shards = math.prod(mesh.shape[a] for a in batch)
    rows_axis = (batch if len(batch) > 1 else batch[0]) if batch and rows % shards == 0 else None
    tensor = LOGICAL_AXIS_RULES["heads"]
    tp = mesh.shape[tensor] if tensor in names else 1
    split = tp > 1 and heads % tp == 0 and kv_heads % tp == 0 and heads_fit(tp)
    return rows_axis, tensor if split else None
