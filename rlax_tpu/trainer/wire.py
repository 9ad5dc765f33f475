"""TrainBatch and numpy arrays <-> their protobuf messages (rlax_tpu/rpc/trainer.proto)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from rlax_tpu.rpc import trainer_pb2 as pb
from rlax_tpu.types import TrainBatch

_ARRAYS = (
    "tokens",
    "prompt_lengths",
    "completion_lengths",
    "behaviour_logprobs",
    "rewards",
    "versions",
)


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


def batch_to_chunks(
    batch: TrainBatch, chunk_bytes: int = 4 * 2**20
) -> Iterator[pb.TrainBatchMessage]:
    """The batch as messages of consecutive row slices of about ``chunk_bytes`` each (at least
    one row per message)."""
    arrays = {name: np.asarray(getattr(batch, name)) for name in _ARRAYS}
    if batch.loss_mask is not None:
        arrays["loss_mask"] = np.asarray(batch.loss_mask, np.float32)
    if batch.routes is not None:
        arrays["routes"] = np.asarray(batch.routes, np.int16)
    rows = len(arrays["tokens"])
    row_bytes = sum(a[:1].nbytes for a in arrays.values())
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, max(rows, 1), step):
        part = {name: array_to_pb(a[start : start + step]) for name, a in arrays.items()}
        yield pb.TrainBatchMessage(
            **part, group_size=batch.group_size, temperature=batch.temperature
        )


def batch_from_chunks(messages: Iterable[pb.TrainBatchMessage]) -> TrainBatch:
    """Joins row slices (``batch_to_chunks``); ValueError for slices that do not fit together."""
    parts = [
        (m, {name: array_from_pb(getattr(m, name), name) for name in _names(m)}) for m in messages
    ]
    if not parts:
        raise ValueError("TrainStep: the stream held no batch")
    first = parts[0][0]
    for m, arrays in parts:
        if (m.group_size, m.temperature) != (first.group_size, first.temperature):
            raise ValueError("TrainStep: slices disagree on group_size or temperature")
        if arrays.keys() != parts[0][1].keys():
            raise ValueError("TrainStep: some slices carry a loss_mask or routes and others do not")
        for name, a in arrays.items():
            if a.shape[1:] != parts[0][1][name].shape[1:]:
                raise ValueError(
                    f"TrainBatch.{name}: slices of widths {a.shape[1:]} and "
                    f"{parts[0][1][name].shape[1:]}"
                )
    joined = {name: np.concatenate([arrays[name] for _, arrays in parts]) for name in parts[0][1]}
    return TrainBatch(**joined, group_size=first.group_size, temperature=first.temperature)


def _names(m: pb.TrainBatchMessage) -> tuple[str, ...]:
    return (*_ARRAYS, *(name for name in ("loss_mask", "routes") if m.HasField(name)))
