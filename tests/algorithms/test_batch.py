"""Bad input gets a clear ValueError naming it, before jit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlax_tpu.algorithms import ObjectiveSpec, RolloutBatch, make_objective, validate_batch
from rlax_tpu.config import AlgorithmConfig

G, T = 4, 5


def _batch(b=8, t=T):
    rng = np.random.default_rng(0)
    mask = np.ones((b, t))
    mask[:, 3:] = 0
    lp = -rng.random((b, t))
    return RolloutBatch(
        logp_old=lp, logp_behaviour=lp, mask=mask, rewards=rng.random(b), logp_ref=lp, values=lp
    )


def _check(batch, name="grpo", group_size=G, max_length=T):
    cfg = AlgorithmConfig(name=name, group_size=group_size)
    make_objective(cfg, max_length=max_length).validate(batch)


def test_good_batch_passes():
    for name in ("grpo", "ppo", "tb", "online_dpo", "reinforce"):
        _check(_batch(), name)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "mask",
            np.ones((8, 4)),
            r"RolloutBatch.mask has shape \(8, 4\), expected \(8, 5\) \(as logp_old\)",
        ),
        (
            "logp_behaviour",
            np.ones((7, 5)),
            r"RolloutBatch.logp_behaviour has shape \(7, 5\), expected \(8, 5\)",
        ),
        ("logp_ref", np.ones((8, 6)), r"RolloutBatch.logp_ref has shape \(8, 6\)"),
        (
            "rewards",
            np.ones(7),
            r"RolloutBatch.rewards has shape \(7,\), expected \(8,\) \(as one per row of logp_old\)",
        ),
        ("rewards", np.ones((8, 1)), r"RolloutBatch.rewards has shape \(8, 1\)"),
        ("logp_old", np.ones(8), r"RolloutBatch.logp_old must be \[B, T\], got shape \(8,\)"),
    ],
)
def test_mismatched_shapes(field, value, message):
    with pytest.raises(ValueError, match=message):
        _check(dataclasses.replace(_batch(), **{field: value}))


@pytest.mark.parametrize("name", ["ppo", "reinforce_pp"])
def test_token_order_advantages_need_a_contiguous_prefix(name):
    mask = _batch().mask.copy()
    mask[6] = [1, 0, 1, 0, 0]
    with pytest.raises(
        ValueError,
        match=r"RolloutBatch.mask row 6 is not a contiguous prefix: position 2 is a completion "
        r"token after a masked one at position 1. The '\w+' advantage walks",
    ):
        _check(dataclasses.replace(_batch(), mask=mask), name)
    mask[6] = [0, 1, 1, 0, 0]  # a leading gap too
    with pytest.raises(ValueError, match=r"row 6 is not a contiguous prefix: position 1"):
        _check(dataclasses.replace(_batch(), mask=mask), name)
    mask[6] = 0  # an empty row is a prefix (of length 0)
    _check(dataclasses.replace(_batch(), mask=mask), name)


@pytest.mark.parametrize("name", ["grpo", "dapo", "rloo", "gspo", "tb"])
def test_other_objectives_take_holes_a_multi_turn_episode_leaves(name):
    mask = _batch().mask.copy()
    mask[6] = [1, 0, 0, 1, 1]  # a model turn, the environment's reply, the next model turn
    _check(dataclasses.replace(_batch(), mask=mask), name)


def test_nan_reward():
    rewards = _batch().rewards.copy()
    rewards[5] = np.nan
    with pytest.raises(
        ValueError, match=r"RolloutBatch.rewards\[5\] is nan: rewards must be finite"
    ):
        _check(dataclasses.replace(_batch(), rewards=rewards))


def test_non_finite_logp_on_a_real_token():
    batch = _batch()
    logp_old = batch.logp_old.copy()
    logp_old[:, 4] = np.nan  # padding: fine
    _check(dataclasses.replace(batch, logp_old=logp_old))
    logp_old[2, 1] = -np.inf
    with pytest.raises(
        ValueError, match="RolloutBatch.logp_old is not finite on a completion token of row 2"
    ):
        _check(dataclasses.replace(batch, logp_old=logp_old))


def test_empty_group():
    mask = _batch().mask.copy()
    mask[4:8] = 0  # group 1 has no completion token
    with pytest.raises(
        ValueError, match="group 1 is empty: none of its 4 samples has a completion token"
    ):
        _check(dataclasses.replace(_batch(), mask=mask))


def test_empty_batch():
    empty = np.zeros((0, T))
    with pytest.raises(ValueError, match="RolloutBatch is empty"):
        _check(RolloutBatch(logp_old=empty, logp_behaviour=empty, mask=empty, rewards=np.zeros(0)))


def test_group_size_one_where_groups_are_needed():
    # AlgorithmConfig already refuses it; validate_batch refuses a spec built another way.
    spec = ObjectiveSpec(name="rloo", advantage="leave_one_out", group_size=1, max_length=T)
    with pytest.raises(
        ValueError, match="group_size 1: rloo compares samples within a group, needs >= 2"
    ):
        validate_batch(_batch(), spec)
    # ... but REINFORCE with no baseline takes G = 1.
    _check(_batch(b=3), "reinforce", group_size=1)


def test_rows_not_a_multiple_of_the_group_size():
    with pytest.raises(ValueError, match="RolloutBatch has 6 rows, not a multiple of group_size 4"):
        _check(_batch(b=6))


def test_mask_must_be_binary():
    mask = _batch().mask.copy()
    mask[0, 0] = 0.5
    with pytest.raises(ValueError, match="RolloutBatch.mask must hold only 0 and 1"):
        _check(dataclasses.replace(_batch(), mask=mask))


def test_completion_longer_than_max_length():
    with pytest.raises(ValueError, match="a completion has 3 tokens, more than max_length 2"):
        _check(_batch(), max_length=2)


@pytest.mark.parametrize(
    "name, overrides, missing",
    [
        ("tb", {}, "logp_ref"),
        ("online_dpo", {}, "logp_ref"),
        ("ppo", {}, "logp_ref"),
        ("grpo", {"kl_estimator": "k3"}, "logp_ref"),
        ("ppo", {}, "values"),
    ],
)
def test_missing_required_input(name, overrides, missing):
    batch = dataclasses.replace(_batch(), **{missing: None})
    cfg = AlgorithmConfig(name=name, group_size=G, **overrides)
    with pytest.raises(
        ValueError, match=f"RolloutBatch.{missing} is required by {name} but is None"
    ):
        make_objective(cfg, max_length=T).validate(batch)
