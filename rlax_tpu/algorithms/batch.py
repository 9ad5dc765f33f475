"""The loss's typed inputs, and the host-side check the controller and trainer run before jit.

Layout: B = num_groups · G rows, group-major (row b is sample b % G of group b // G), and T
completion positions (position 0 is the first generated token). ``mask`` marks real tokens; padding
may hold anything (it never reaches the loss).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from rlax_tpu.algorithms.spec import ObjectiveSpec

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """What the trainer knows about a batch before the update (all padded, see module docstring).

    logp_old: [B, T] log π_old(o_t), recomputed by the trainer (DESIGN §6).
    logp_behaviour: [B, T] log μ(o_t), as logged by the inference worker that sampled.
    mask: [B, T] 1 for completion tokens, 0 for padding.
    rewards: [B] sequence rewards (after any shaping).
    logp_ref: [B, T] log π_ref(o_t); needed by KL terms, tb and online_dpo.
    values: [B, T] value-model predictions at rollout time; needed by ppo.
    """

    logp_old: Array
    logp_behaviour: Array
    mask: Array
    rewards: Array
    logp_ref: Array | None = None
    values: Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LossInputs:
    """Everything the loss needs besides the current log-probs; made by ``Objective.prepare``.

    Every [B, T] field is per token, so slicing rows gives a micro-batch whose losses sum to the
    full batch's (aggregation weights are normalized over the full batch). tb and online_dpo
    compare samples of a group inside the loss: their micro-batches must hold whole groups.

    agg_weight: [B, T] w_{i,t} (0 on padding).  advantages: [B, T] A_{i,t} (0 on padding).
    behaviour_weight: [B, T] the truncated/masked π_old/μ correction (1 when off).
    returns: [B, T] value targets (ppo) or None.  beta: [] tb/online_dpo temperature β.
    """

    logp_old: Array
    logp_behaviour: Array
    logp_ref: Array | None
    mask: Array
    rewards: Array
    agg_weight: Array
    advantages: Array
    behaviour_weight: Array
    values_old: Array | None
    returns: Array | None
    beta: Array


def _shape_error(name: str, got: tuple, want: tuple, ref: str) -> ValueError:
    return ValueError(f"RolloutBatch.{name} has shape {got}, expected {want} (as {ref})")


# Advantage estimators that run a recursion over each completion's tokens (a hole would cut it).
TOKEN_ORDER_ADVANTAGES = ("gae", "batch_norm_kl_reward")


def validate_batch(batch: RolloutBatch, spec: ObjectiveSpec) -> None:
    """Raises ValueError naming the bad input. Host-side (numpy), call it before jit.

    Checks shapes, group layout (B a multiple of G, G >= 2 where groups are compared, no group
    without a completion token), 0/1 masks (contiguous prefixes per row for the
    TOKEN_ORDER_ADVANTAGES), finite rewards and finite log-probs on real tokens,
    completion lengths <= spec.max_length, and the inputs the algorithm needs.
    """
    logp_old = np.asarray(batch.logp_old)
    if logp_old.ndim != 2:
        raise ValueError(f"RolloutBatch.logp_old must be [B, T], got shape {logp_old.shape}")
    b, t = logp_old.shape
    if b == 0:
        raise ValueError("RolloutBatch is empty: logp_old has 0 rows (no groups)")
    fields = {"logp_old": logp_old}
    for name in ("logp_behaviour", "mask", "logp_ref", "values"):
        value = getattr(batch, name)
        if value is None:
            continue
        value = np.asarray(value)
        if value.shape != (b, t):
            raise _shape_error(name, value.shape, (b, t), "logp_old")
        fields[name] = value
    rewards = np.asarray(batch.rewards)
    if rewards.shape != (b,):
        raise _shape_error("rewards", rewards.shape, (b,), "one per row of logp_old")
    mask = fields["mask"]
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("RolloutBatch.mask must hold only 0 and 1")
    real = mask > 0
    # GAE and returns-to-go walk a row's tokens in order, and a hole cuts their recursion. Other
    # estimators take holes: a multi-turn episode's environment tokens inside its completion.
    gap = np.argwhere(real[:, 1:] & ~real[:, :-1])
    if gap.size and spec.advantage in TOKEN_ORDER_ADVANTAGES:
        row, col = (int(i) for i in gap[0])
        raise ValueError(
            f"RolloutBatch.mask row {row} is not a contiguous prefix: position {col + 1} is a "
            f"completion token after a masked one at position {col}. The {spec.advantage!r} "
            "advantage walks each completion's tokens in order; multi-turn episodes (environment "
            "tokens masked inside a completion) need one that does not (grpo, dapo, rloo, ...)"
        )
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        raise ValueError(
            f"RolloutBatch.rewards[{bad[0]}] is {rewards[bad[0]]}: rewards must be finite"
        )
    for name in ("logp_old", "logp_behaviour", "logp_ref", "values"):
        if name in fields and not np.isfinite(fields[name][real]).all():
            row = int(np.argwhere(real & ~np.isfinite(fields[name]))[0, 0])
            raise ValueError(
                f"RolloutBatch.{name} is not finite on a completion token of row {row}"
            )
    lengths = mask.sum(axis=1)
    if lengths.max() > spec.max_length:
        raise ValueError(
            f"RolloutBatch.mask: a completion has {int(lengths.max())} tokens, more than "
            f"max_length {spec.max_length}"
        )
    for name in spec.required_inputs:
        if name not in fields:
            raise ValueError(f"RolloutBatch.{name} is required by {spec.name} but is None")
    g = spec.group_size
    if spec.needs_groups:
        if g < 2:
            raise ValueError(
                f"group_size {g}: {spec.name} compares samples within a group, needs >= 2"
            )
        if b % g:
            raise ValueError(f"RolloutBatch has {b} rows, not a multiple of group_size {g}")
        empty = np.flatnonzero(lengths.reshape(b // g, g).sum(axis=1) == 0)
        if empty.size:
            raise ValueError(
                f"group {empty[0]} is empty: none of its {g} samples has a completion token"
            )
