"""Rollouts of multi-turn episodes pack into TrainBatches whose loss mask leaves out the
environment's tokens; bad shapes are refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlax_tpu.types import FinishReason, Rollout, TrainBatch


def _rollout(i: int, n: int, sampled=None) -> Rollout:
    return Rollout(
        prompt_id="p",
        sample_index=i,
        prompt_tokens=np.arange(3, dtype=np.int32),
        tokens=np.arange(10, 10 + n, dtype=np.int32),
        logprobs=np.full(n, -1.0, np.float32),
        versions=np.zeros(n, np.int64),
        finish_reason=FinishReason.EOS,
        sampled=sampled,
    )


def test_an_episodes_environment_tokens_are_out_of_the_loss_mask():
    episode = np.array([1, 1, 0, 0, 0, 1], bool)  # turn, the environment's reply, turn
    batch = TrainBatch.from_rollouts(
        [_rollout(0, 6, episode), _rollout(1, 4)], np.zeros(2), group_size=2
    )
    np.testing.assert_array_equal(batch.completion_mask(), [[1, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]])
    # Single-turn batches carry no mask: every completion token trains.
    single = TrainBatch.from_rollouts([_rollout(0, 6), _rollout(1, 4)], np.zeros(2), group_size=2)
    assert single.loss_mask is None
    np.testing.assert_array_equal(single.completion_mask().sum(axis=1), [6, 4])


def test_bad_masks_are_refused():
    with pytest.raises(ValueError, match=r"sampled has shape \(5,\), expected \(6,\)"):
        _rollout(0, 6, np.ones(5, bool))
    batch = TrainBatch.from_rollouts([_rollout(0, 6), _rollout(1, 4)], np.zeros(2), group_size=2)
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 5\), expected"):
        dataclasses.replace(batch, loss_mask=np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1"):
        dataclasses.replace(batch, loss_mask=np.full((2, 6), 0.5, np.float32))
