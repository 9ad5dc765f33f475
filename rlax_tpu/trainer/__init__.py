"""Trainer service: sharded JAX train steps, aligned log-prob recompute, Orbax checkpoints.

    from rlax_tpu.trainer import Trainer, WeightSink
    trainer = Trainer(run_config, sink=sink)     # sink.push(params, version)
    metrics = trainer.train_step(batch)          # types.TrainBatch -> dict of floats
    trainer.publish(); trainer.save(); trainer.restore(); trainer.status()

gRPC: ``python -m rlax_tpu.trainer`` serves the same calls; ``TrainerClient`` calls them.
"""

from rlax_tpu.trainer.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    NoCheckpointError,
)
from rlax_tpu.trainer.client import TrainerClient
from rlax_tpu.trainer.mesh import BatchShapeError
from rlax_tpu.trainer.trainer import (
    NonFiniteLossError,
    Trainer,
    TrainerHalted,
    TrainerStatus,
    WeightSink,
)

__all__ = [
    "BatchShapeError",
    "CheckpointMismatchError",
    "NoCheckpointError",
    "CorruptCheckpointError",
    "NonFiniteLossError",
    "Trainer",
    "TrainerClient",
    "TrainerHalted",
    "TrainerStatus",
    "WeightSink",
]
