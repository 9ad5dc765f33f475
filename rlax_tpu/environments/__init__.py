"""Environments of multi-turn episodes: after each model turn an environment answers with a
message, a reward, or both, and says when the episode is done (issue [multi-turn]).

An environment is a function of the episode's transcript: ``reply(problem, answers, tools)``
sees the model's answers so far (the last one new) and the tools the controller lends it (the
run's verifier), so an episode in flight is resumed from its tokens alone. Built-in:
``code_repair`` (the verifier's verdict on the program as feedback, up to ``max_turns``
attempts) and ``python_tool`` (math: fenced Python blocks run in the sandbox, their output comes
back, the final answer is graded). User code adds its own with ``register_environment`` from a module named in
``algorithm.plugins``.

``environment.name`` chooses one (controller/episodes.py plays the episodes; deterministic mode
only so far).
"""

from rlax_tpu.environments.api import (
    Environment,
    Reply,
    Tools,
    environment,
    episode_reward,
    instructions,
    known_environments,
    register_environment,
)
from rlax_tpu.environments.code_repair import CodeRepair, feedback
from rlax_tpu.environments.python_tool import PythonTool, tool_call, tool_output

__all__ = [
    "CodeRepair",
    "Environment",
    "Reply",
    "Tools",
    "environment",
    "episode_reward",
    "feedback",
    "instructions",
    "known_environments",
    "PythonTool",
    "register_environment",
    "tool_call",
    "tool_output",
]
