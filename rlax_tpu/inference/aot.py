"""The inference engine's programs, described abstractly for ahead-of-time compilation
(``python -m rlax_tpu.aot``): decode (sampler fused), prefill and page copy at the shapes an
engine built from the config compiles, with the target platform's attention kernel, on the
engine's mesh (``inference.mesh``) over the first devices of the topology. Each program's note
gives the KV pages a device holds: 1/data of them with data shards (``engine.py``), 1/tensor
more where the KV heads split.

With the default one-device mesh a worker runs on one chip: on a slice of several chips the
programs are compiled for its first chip, and the report says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from rlax_tpu import models
from rlax_tpu.config import MeshConfig, RunConfig
from rlax_tpu.inference.engine import engine_mesh
from rlax_tpu.models.aot import AbstractProgram, abstract, device_bytes, engine_programs
from rlax_tpu.models.paged_cache import cache_shardings


def abstract_programs(config: RunConfig, devices: Sequence[jax.Device]) -> list[AbstractProgram]:
    """The engine's programs for ``config`` on ``devices`` (a topology's devices)."""
    mesh = engine_mesh(config.inference, list(devices))
    shape = models.ReplayShape.of_engine(
        config.inference,
        config.model,
        platform=devices[0].platform,
        data_shards=mesh.shape["data"] if mesh is not None else 1,
    )
    graphdef, state = nnx.split(models.abstract_model(config.model))
    cache = jax.eval_shape(lambda: shape.make_cache(config.model))
    if mesh is None:
        one = SingleDeviceSharding(devices[0])
        state, cache_sharding, io = abstract(state, one), one, one
        note = (
            f"one chip of {len(devices)}: inference.mesh is one device" if len(devices) > 1 else ""
        )
        # Traced under a one-chip mesh all the same: Mosaic reads the target chip from the
        # context mesh, and would otherwise take this host's default device (a CPU).
        mesh = models.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), list(devices[:1]))
    else:
        state = abstract(state, models.param_shardings(state, mesh))
        cache_sharding = cache_shardings(cache, mesh)
        io = NamedSharding(mesh, PartitionSpec())
        note = f"inference.mesh {dict(mesh.shape)} over {mesh.size} of {len(devices)} chips"
    kv = device_bytes(abstract(cache, cache_sharding))
    note = f"{note}; " if note else ""
    note += f"KV pages {kv / 2**20:.1f} MiB per device"
    if shape.data_shards > 1:
        note += f" (1/{shape.data_shards} of the pages per data shard)"
    # A reload places the new version beside the one being served (engine.load_weights), so
    # decode and prefill are checked with a second copy of the weights held: an upper bound of
    # the reload's own peak (two copies + the cache), which runs no program.
    weights = device_bytes(state)
    return engine_programs(
        "inference",
        config.model,
        shape,
        graphdef=graphdef,
        state=state,
        cache_sharding=cache_sharding,
        io_sharding=io,
        mesh=mesh,
        note=note,
        held={"next version's weights (reload)": weights},
        copy_held={"weights": weights},
    )
