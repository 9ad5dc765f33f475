"""TrainBatch and numpy arrays <-> their protobuf messages (rlax_tpu/rpc/trainer.proto)."""

from __future__ import annotations

import numpy as np

from rlax_tpu.rpc import trainer_pb2 as pb
from rlax_tpu.types import TrainBatch

_ARRAYS = (
    "tokens", "prompt_lengths", "completion_lengths", "behaviour_logprobs", "rewards", "versions"
)  # fmt: skip


def array_to_pb(x: np.ndarray) -> pb.TrainerArray:
    x = np.ascontiguousarray(x)
    little = x.astype(x.dtype.newbyteorder("<"), copy=False)
    return pb.TrainerArray(data=little.tobytes(), shape=list(x.shape), dtype=x.dtype.name)


def array_from_pb(msg: pb.TrainerArray, field: str) -> np.ndarray:
    try:
        dtype = np.dtype(msg.dtype).newbyteorder("<")
    except TypeError as e:
        raise ValueError(f"TrainBatch.{field}: unknown dtype {msg.dtype!r}") from e
    shape = tuple(msg.shape)
    if len(msg.data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(
            f"TrainBatch.{field}: {len(msg.data)} bytes do not hold a {msg.dtype} array of "
            f"shape {shape}"
        )
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def batch_to_pb(batch: TrainBatch) -> pb.TrainBatchMessage:
    arrays = {name: array_to_pb(np.asarray(getattr(batch, name))) for name in _ARRAYS}
    return pb.TrainBatchMessage(
        **arrays, group_size=batch.group_size, temperature=batch.temperature
    )


def batch_from_pb(msg: pb.TrainBatchMessage) -> TrainBatch:
    """Raises ValueError for malformed arrays or an inconsistent batch."""
    arrays = {name: array_from_pb(getattr(msg, name), name) for name in _ARRAYS}
    return TrainBatch(**arrays, group_size=msg.group_size, temperature=msg.temperature)
