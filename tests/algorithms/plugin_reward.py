"""A user's own reward function, as a plugin module (``--config.algorithm.reward=brevity
--config.algorithm.plugins='("tests.algorithms.plugin_reward",)'``): accepted answers earn 1,
minus 0.01 per generated token. Every input it sees is kept in SEEN for the tests."""

from __future__ import annotations

from rlax_tpu.algorithms import RewardInput, register_reward

SEEN: list[RewardInput] = []


def brevity(x: RewardInput) -> float:
    SEEN.append(x)
    return float(x.verdict.accepted) - 0.01 * len(x.tokens)


register_reward("brevity", brevity)
