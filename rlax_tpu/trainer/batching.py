"""Splitting a TrainBatch into micro-batches bucketed by length, and their padded host arrays.

Rows (or, for objectives that compare samples of a group, whole groups) are sorted by length,
longest first, and cut into micro-batches of ``micro_batch_size`` rows; each micro-batch is padded
only to its own longest row, rounded up to a multiple of ``bucket`` (so the number of compiled
shapes stays small). Sorting puts rows of similar length together, which bounds the padding:
the padding fraction is reported for the plan and for the unsorted layout it replaces.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_tpu.trainer.mesh import BatchShapeError
from rlax_tpu.types import TrainBatch


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def possible_shapes(
    *, bucket: int, max_prompt_len: int, max_new_tokens: int
) -> list[tuple[int, int]]:
    """Every (length L, width T) a micro-batch can take under these limits (T <= L)."""
    longest = _round_up(max_prompt_len + max_new_tokens, bucket)
    widest = _round_up(max_new_tokens, bucket)
    return [
        (length, width)
        for length in range(bucket, longest + 1, bucket)
        for width in range(bucket, min(length, widest) + 1, bucket)
    ]


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """rows: [b] indices into the TrainBatch; length: padded token columns L; width: padded
    completion columns T (both multiples of the bucket)."""

    rows: np.ndarray
    length: int
    width: int


@dataclasses.dataclass(frozen=True)
class Plan:
    micro_batches: list[MicroBatch]
    padding_fraction: float  # padded token slots / all token slots, this plan
    padding_fraction_unsorted: float  # the same for one micro-batch per consecutive row block

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)


def plan_micro_batches(
    batch: TrainBatch,
    *,
    micro_batch_size: int,
    whole_groups: bool,
    bucket: int,
    row_multiple: int = 1,
) -> Plan:
    """Raises BatchShapeError if the rows do not split into equal micro-batches that fit the mesh
    (``row_multiple`` rows per shard) or, with ``whole_groups``, into whole groups."""
    b, g = batch.num_rows, batch.group_size
    if b == 0:
        raise BatchShapeError("TrainBatch is empty")
    mbs = min(micro_batch_size, b)
    # A last, smaller micro-batch is fine for Eq.-3 objectives (their micro-batch losses sum to
    # the batch's): the controller may drop groups (verifier failures, dynamic sampling). It
    # costs one more compiled shape. Group objectives average equal micro-batches: no remainder.
    if b % mbs and (whole_groups or (b % mbs) % row_multiple):
        raise BatchShapeError(
            f"TrainBatch has {b} rows, not a multiple of trainer.micro_batch_size {mbs}"
        )
    if mbs % row_multiple:
        raise BatchShapeError(
            f"micro-batches of {mbs} rows do not split evenly over the mesh's {row_multiple} "
            f"batch shards; use a micro_batch_size that is a multiple of {row_multiple}"
        )
    if whole_groups and mbs % g:
        raise BatchShapeError(
            f"this objective needs whole groups per micro-batch: micro_batch_size {mbs} is not "
            f"a multiple of group_size {g}"
        )
    total = np.asarray(batch.prompt_lengths) + np.asarray(batch.completion_lengths)
    completion = np.asarray(batch.completion_lengths)
    if whole_groups:
        group_len = total.reshape(-1, g).max(axis=1)
        groups = np.argsort(-group_len, kind="stable")
        order = (groups[:, None] * g + np.arange(g)[None, :]).reshape(-1)
    else:
        order = np.argsort(-total, kind="stable")
    mbatches = []
    for lo in range(0, b, mbs):
        rows = order[lo : lo + mbs]
        mbatches.append(
            MicroBatch(
                rows=rows,
                length=_round_up(int(total[rows].max()), bucket),
                width=_round_up(int(completion[rows].max()), bucket),
            )
        )
    real = float(total.sum())
    slots = float(sum(len(m.rows) * m.length for m in mbatches))
    unsorted = float(
        sum(
            len(total[lo : lo + mbs]) * _round_up(int(total[lo : lo + mbs].max()), bucket)
            for lo in range(0, b, mbs)
        )
    )
    return Plan(mbatches, 1.0 - real / slots, 1.0 - real / unsorted)


def micro_arrays(batch: TrainBatch, mb: MicroBatch, routes: bool = True) -> dict[str, np.ndarray]:
    """Padded host arrays of one micro-batch.

    tokens, positions: [b, L] int32 (padding at position -1); prompt_lengths: [b] int32;
    targets: [b, T] int32 completion tokens (0 on padding); when the batch carries routes and
    ``routes`` asks for them, routes: [b, L, layers, k] int16 (-1 on padding).
    """
    tokens = np.asarray(batch.tokens)[mb.rows]
    prompt = np.asarray(batch.prompt_lengths, np.int32)[mb.rows]
    total = prompt + np.asarray(batch.completion_lengths, np.int32)[mb.rows]
    b, have = tokens.shape
    padded = np.zeros((b, mb.length), np.int32)
    padded[:, : min(have, mb.length)] = tokens[:, : mb.length]
    cols = np.arange(mb.length)[None, :]
    positions = np.where(cols < total[:, None], cols, -1).astype(np.int32)
    padded = np.where(positions >= 0, padded, 0)
    tcols = prompt[:, None] + np.arange(mb.width)[None, :]
    targets = np.take_along_axis(padded, np.minimum(tcols, mb.length - 1), axis=1)
    completion = np.asarray(batch.completion_lengths)[mb.rows]
    targets = np.where(np.arange(mb.width)[None, :] < completion[:, None], targets, 0)
    arrays = dict(tokens=padded, positions=positions, prompt_lengths=prompt, targets=targets)
    if routes and batch.routes is not None:
        rows = np.asarray(batch.routes, np.int16)[mb.rows]
        arrays["routes"] = np.full((b, mb.length, *rows.shape[2:]), -1, np.int16)
        arrays["routes"][:, : min(have, mb.length)] = rows[:, : mb.length]
        arrays["routes"][positions < 0] = -1
    return arrays
