"""The environment section: multi-turn episodes (rlax_tpu/environments)."""

from __future__ import annotations

from typing import Literal

from rlax_tpu.config.checks import ConfigError, frozen, in_range, non_negative, positive

ENVIRONMENTS = ("code_repair", "python_tool")
# Environments user code registered (rlax_tpu.environments.register_environment), from modules
# named in algorithm.plugins.
_REGISTERED_ENVIRONMENTS: list[str] = []


def register_environment_name(name: str) -> None:
    """Makes ``name`` a valid environment.name (called by environments.register_environment)."""
    if name in ENVIRONMENTS or name == "none":
        raise ValueError(f"{name!r} is a built-in environment; register another name")
    if name not in _REGISTERED_ENVIRONMENTS:
        _REGISTERED_ENVIRONMENTS.append(name)


def known_environments() -> tuple[str, ...]:
    return (*ENVIRONMENTS, *_REGISTERED_ENVIRONMENTS)


@frozen
class EnvironmentConfig:
    # 'none': single-turn rollouts. Else the environment that answers each model turn:
    # code_repair (the verifier's verdict as feedback), python_tool (math: fenced Python blocks
    # run in the sandbox, their output comes back) or one a plugin registered. An episode's
    # turns and the environment's replies share inference.max_new_tokens, and only the model's
    # tokens are trained on.
    name: str = "none"
    max_turns: int = 2  # model turns per episode (code_repair: attempts; python_tool: calls + 1)
    # At most this many tokens per model turn (0: up to what the episode has left), so that a
    # first turn cannot spend the whole budget.
    turn_tokens: int = 0
    # The episode's reward from its turns' rewards: the last turn's, or the sum of
    # discount^k * reward of turn k (an answer right at once is worth the most).
    reward: Literal["last", "discounted"] = "last"
    discount: float = 1.0  # for reward = 'discounted'
    # How a step's episodes take turns. 'episode': each episode's environment call starts as
    # soon as its turn is generated, and its next turn is submitted as soon as the reply is
    # ready (in deterministic mode only where every worker's engine is batch-invariant,
    # rows_bitwise; else lock-step, with a warning). 'lockstep': every turn k of the step is
    # generated before any environment call on it, and the next turns go together.
    schedule: Literal["episode", "lockstep"] = "episode"
    # Environment calls (replies, tool runs) at once, over all episodes of the run.
    concurrency: int = 64
    # Seconds an environment's reply may take (0: no bound). A reply that raises or takes longer
    # ends its episode with the error recorded: its group is left out of the loss (as a
    # verifier failure is), counted in episode/environment_errors and _timeouts, and the run
    # goes on (a resumed run meets the same episode again and cuts it again).
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        positive(self, "max_turns")
        positive(self, "concurrency")
        non_negative(self, "timeout_s")
        non_negative(self, "turn_tokens")
        in_range(self, "discount", 0.0, 1.0)

    def check_name(self) -> None:
        """After algorithm.plugins are imported (RunConfig): they may register environments."""
        if self.name != "none" and self.name not in known_environments():
            raise ConfigError(
                "environment.name",
                f"unknown environment; known: {['none', *known_environments()]} (an "
                "environment of your own is registered by a module in algorithm.plugins)",
                self.name,
            )
