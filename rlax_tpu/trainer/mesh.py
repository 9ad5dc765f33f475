"""The trainer's device mesh and the shardings of its inputs.

Parameters follow the model's logical-axis rules (``models.LOGICAL_AXIS_RULES``); batch rows are
split over the axes the rules give the logical ``batch`` axis (data, fsdp, expert), so a micro-batch's
row count must be a multiple of their product.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu import models
from rlax_tpu.config import MeshConfig

# ("data", "fsdp", "expert")
BATCH_AXES: tuple[str, ...] = tuple(models.LOGICAL_AXIS_RULES["batch"])
TENSOR_AXIS = "tensor"


class BatchShapeError(ValueError):
    """A batch whose shape does not fit the mesh or the micro-batching config."""


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (data, fsdp, expert, tensor) mesh over ``devices`` (default: every device of every process)."""
    return models.make_mesh(cfg, devices)


def batch_shards(mesh: Mesh) -> int:
    """How many ways batch rows are split."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Rows split over the batch axes, the other ``ndim - 1`` dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_rows_fit(rows: int, mesh: Mesh, what: str) -> None:
    """Raises BatchShapeError unless ``rows`` splits evenly over the batch axes."""
    shards = batch_shards(mesh)
    if rows % shards:
        axes = " x ".join(f"{a}={mesh.shape[a]}" for a in BATCH_AXES)
        raise BatchShapeError(
            f"{what} has {rows} rows, which do not split evenly over the mesh's batch axes "
            f"({axes} = {shards} shards); use a multiple of {shards}"
        )


def put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array that every process holds in full (multi-process safe)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
