"""The environment protocol, the registry of environments by name, and episode rewards."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from rlax_tpu.config import ENVIRONMENTS, register_environment_name
from rlax_tpu.data.problems import Problem
from rlax_tpu.types import Verdict


@dataclasses.dataclass(frozen=True)
class Reply:
    """An environment's answer to the model's latest turn.

    ``text``: the next message to the model (a user turn); None ends the episode. ``reward``:
    the latest turn's reward. ``verdict``: what the verifier said of that turn, if it was asked.
    """

    text: str | None
    reward: float = 0.0
    verdict: Verdict | None = None


class Tools(Protocol):
    """What the controller lends an environment."""

    def verify(self, problem: Problem, answer: str) -> Verdict:
        """The run's verifier on one answer to ``problem``, as a single-turn rollout is graded
        (the program extracted from the answer the same way; none: a compile error)."""
        ...

    def run(self, code: str, *, language: str = "python", stdin: str = "") -> Verdict:
        """Runs ``code`` in the verifier's sandbox (a tool call): ACCEPTED with what it printed
        as ``detail``, or the failure with its output and stderr tail."""
        ...


class Environment(Protocol):
    """An environment may also have ``instructions``: text appended to every prompt's user turn
    (how to call its tools)."""

    def reply(self, problem: Problem, answers: Sequence[str], tools: Tools) -> Reply:
        """The answer to the model's turns ``answers`` (oldest first, the last one new). A pure
        function of its arguments and the tools' results: a resumed episode calls it again."""
        ...


EnvironmentFactory = Callable[[int], Environment]  # max_turns -> the environment
_REGISTRY: dict[str, EnvironmentFactory] = {}


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Makes ``name`` an environment; ``factory(max_turns)`` builds it once per run."""
    if not callable(factory):
        raise TypeError(f"register_environment({name!r}): {factory!r} is not callable")
    if not name or name == "none":
        raise ValueError(f"{name!r} cannot name an environment")
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} exists already")
    if name not in ENVIRONMENTS:
        register_environment_name(name)  # a plugin's: environment.name may now say it
    _REGISTRY[name] = factory


def known_environments() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def instructions(name: str) -> str:
    """What environment ``name`` adds to the prompts ("" for none or when it adds nothing)."""
    factory = _REGISTRY.get(name)
    return str(getattr(factory, "instructions", "") or "")


def environment(name: str, *, max_turns: int) -> Environment:
    """The environment ``name`` for episodes of at most ``max_turns`` model turns."""
    if max_turns < 1:
        raise ValueError(f"an episode needs max_turns >= 1, got {max_turns}")
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown environment {name!r}; known: {list(known_environments())}"
        ) from None
    return factory(max_turns)


def episode_reward(
    rewards: Sequence[float], *, mode: Literal["last", "discounted"], discount: float = 1.0
) -> float:
    """The episode's reward from its turns' rewards: the last turn's, or Σ_k discount^k · r_k
    over turns k = 0, 1, ... (an answer right at the first attempt is worth the most)."""
    if not rewards:
        raise ValueError("an episode has at least one turn")
    if mode == "last":
        return float(rewards[-1])
    if mode == "discounted":
        return float(sum(discount**k * r for k, r in enumerate(rewards)))
    raise ValueError(f"unknown episode reward {mode!r}: 'last' or 'discounted'")
