"""Reward functions: the built-ins' values, a bad return value named, internal errors unscored,
unknown and duplicate names refused. (A plugin's reward through the controller:
tests/controller/test_objectives_run.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlax_tpu.algorithms import RewardInput, register_reward
from rlax_tpu.algorithms.rewards import reward_fn, score
from rlax_tpu.config import AlgorithmConfig, ConfigError
from rlax_tpu.types import Verdict, VerdictKind


def _input(kind: VerdictKind, score_: float = 0.0) -> RewardInput:
    return RewardInput(
        verdict=Verdict(kind=kind, score=score_, tests_passed=1, tests_total=4),
        tokens=np.zeros(3, np.int32),
        problem=None,
        finished=True,
        decode=lambda t: "x",
    )


def test_builtin_rewards():
    accepted, wrong = _input(VerdictKind.ACCEPTED, 1.0), _input(VerdictKind.WRONG_ANSWER, 0.25)
    assert score(reward_fn("verdict"), accepted) == 1.0
    assert score(reward_fn("verdict"), wrong) == 0.0
    assert score(reward_fn("partial"), accepted) == 1.0
    assert score(reward_fn("partial"), wrong) == 0.25
    # An internal error is not the model's fault: no reward, whatever the function.
    assert score(lambda x: 5.0, _input(VerdictKind.INTERNAL_ERROR)) is None


@pytest.mark.parametrize("value", [math.nan, math.inf, "1.0", None])
def test_a_reward_that_is_not_a_finite_number_is_named(value):
    with pytest.raises(ValueError, match="reward function 'mine' returned .* finite number"):
        score(lambda x: value, _input(VerdictKind.ACCEPTED), name="mine")
    assert score(lambda x: True, _input(VerdictKind.ACCEPTED)) == 1.0  # bools and ints count
    assert score(lambda x: np.float32(0.5), _input(VerdictKind.ACCEPTED)) == 0.5


def test_unknown_and_duplicate_reward_functions_are_refused():
    with pytest.raises(ConfigError, match="reward.*name the module that registers it"):
        AlgorithmConfig(name="grpo", reward="nope")
    with pytest.raises(ValueError, match="built-in"):
        register_reward("verdict", lambda x: 0.0)
    with pytest.raises(TypeError, match="not callable"):
        register_reward("other", 3)
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        reward_fn("nope")
