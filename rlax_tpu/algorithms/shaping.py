"""Batch-level reward shaping and group filtering the controller applies on the host (numpy)."""

from __future__ import annotations

import numpy as np


def dynamic_sampling_filter(rewards: np.ndarray) -> tuple[np.ndarray, int]:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal.

    rewards: [N, G], finite (ValueError otherwise). Returns (keep: [N] bool, number of groups
    dropped). A dropped group has zero group-relative advantage everywhere, so it would only
    dilute the batch.
    """
    rewards = np.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
    # NaN compares false, so max > min would silently drop a group with a NaN reward as "all equal".
    bad = np.argwhere(~np.isfinite(rewards))
    if bad.size:
        group, sample = (int(i) for i in bad[0])
        raise ValueError(
            f"rewards of group {group} (sample {sample}) is {rewards[group, sample]}: "
            "rewards must be finite"
        )
    keep = rewards.max(axis=1) > rewards.min(axis=1)
    return keep, int((~keep).sum())


def overlong_penalty(
    lengths: np.ndarray, *, max_length: int, buffer: int, penalty: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong punishment, added to the reward: [B] lengths -> [B] values <= 0.

    0 up to max_length − buffer, then falling linearly to −penalty at max_length, −penalty beyond.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    lengths = np.asarray(lengths, dtype=np.float64)
    start = max_length - buffer
    shaped = np.clip((start - lengths) / buffer, -1.0, 0.0)
    return penalty * shaped
