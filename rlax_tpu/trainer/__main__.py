"""Trainer service: sharded JAX train steps, aligned log-prob recompute, Orbax checkpoints.

Serves train_step(batch), publish, save, restore and status over gRPC on trainer.address.
"""

from __future__ import annotations

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    # Not built yet: say so instead of pretending (#8 [trainer]).
    return cli.not_built("trainer", "#8 [trainer]", config)


if __name__ == "__main__":
    cli.main("trainer", run)
