"""The inference engine's programs, described abstractly for ahead-of-time compilation
(``python -m rlax_tpu.aot``): decode (sampler fused), prefill and page copy at the shapes an
engine built from the config compiles, with the target platform's attention kernel.

The engine has no mesh yet: it runs on one device, so on a slice of several chips its programs
are compiled for the slice's first chip, and the report says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from rlax_tpu import models
from rlax_tpu.config import RunConfig
from rlax_tpu.models.aot import AbstractProgram, abstract, engine_programs


def abstract_programs(
    config: RunConfig, devices: Sequence[jax.Device]
) -> list[AbstractProgram]:
    """The engine's programs for ``config`` on ``devices`` (a topology's devices)."""
    device = devices[0]
    one = SingleDeviceSharding(device)
    shape = models.ReplayShape.of_engine(config.inference, config.model, platform=device.platform)
    graphdef, state = nnx.split(models.abstract_model(config.model))
    note = ""
    if len(devices) > 1:
        note = (
            f"one chip of {len(devices)}: the engine has no mesh yet ([sharded-inference]), "
            "so each worker is one device"
        )
    return list(
        engine_programs(
            "inference", config.model, shape, graphdef=graphdef, state=abstract(state, one),
            cache_sharding=one, io_sharding=one, note=note,
        )  # fmt: skip
    )
