"""Reward functions: one rollout's verdict (and its text) -> a scalar reward.

``algorithm.reward`` names one. Built-in: ``verdict`` (1 accepted, 0 otherwise) and ``partial``
(the fraction of tests passed, ``Verdict.score``: 1 when accepted). User code adds its own with
``register_reward`` from a module named in ``algorithm.plugins``, e.g. a format bonus::

    def concise(x: RewardInput) -> float:
        return float(x.verdict.accepted) - 0.001 * len(x.tokens)

    register_reward("concise", concise)

A verifier's internal error never reaches a reward function: that rollout has no reward (it
says nothing about the model) and its group is not trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from rlax_tpu.config import register_reward_name
from rlax_tpu.types import Verdict, VerdictKind


@dataclasses.dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one rollout; ``completion`` is decoded on first use (the
    built-in rewards never read it, and the verifier's tasks already decoded it once)."""

    verdict: Verdict
    tokens: np.ndarray  # [T] int32, the generated token ids
    problem: Any  # the data record (rlax_tpu.data.Problem): a code, unit-test or math problem
    finished: bool  # the model stopped by itself (False: cut at max_new_tokens)
    decode: Callable[[np.ndarray], str]  # token ids -> text (the run's tokenizer)

    @functools.cached_property
    def completion(self) -> str:
        """The generated text."""
        return self.decode(self.tokens)


RewardFn = Callable[[RewardInput], float]


def _verdict(x: RewardInput) -> float:
    return 1.0 if x.verdict.accepted else 0.0


def _partial(x: RewardInput) -> float:
    return 1.0 if x.verdict.accepted else float(x.verdict.score)


REWARDS: dict[str, RewardFn] = {"verdict": _verdict, "partial": _partial}


def register_reward(name: str, fn: RewardFn) -> None:
    """Adds a reward function usable as ``algorithm.reward = name`` once the module calling
    this is in ``algorithm.plugins``. ``fn(RewardInput) -> float`` runs on the controller's
    host, once per rollout; it must return a finite number."""
    if not callable(fn):
        raise TypeError(f"register_reward({name!r}): {fn!r} is not callable")
    register_reward_name(name)  # refuses built-in names
    if name in REWARDS:
        raise ValueError(f"reward function {name!r} exists already")
    REWARDS[name] = fn


def reward_fn(name: str) -> RewardFn:
    """The reward function ``name`` (built-in or registered)."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; known: {sorted(REWARDS)}") from None


def score(fn: RewardFn, x: RewardInput, *, name: str = "") -> float | None:
    """fn's reward for x; None for an internal error (no reward). Raises ValueError naming the
    function if it returns something other than a finite number."""
    if x.verdict.kind is VerdictKind.INTERNAL_ERROR:
        return None
    value = fn(x)
    out = float(value) if isinstance(value, int | float | np.number) else math.nan
    if not math.isfinite(out):
        raise ValueError(
            f"reward function {name or fn!r} returned {value!r} for "
            f"{x.verdict.kind.value}: it must return a finite number"
        )
    return out
