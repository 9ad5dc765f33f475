"""``python_tool``: math with a Python interpreter. A turn that ends in a fenced ```python block
(no final answer after it) is a tool call: the sandbox runs the block and what it printed (or why
it failed) comes back as the next user turn, in an ```output block. A turn with a final answer is
graded, and so is the last turn the budget allows; its reward is 1 when the answer is right.
Tool turns earn 0 (``environment.reward = 'last'`` rewards the graded answer alone)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlax_tpu.data.problems import Problem
from rlax_tpu.environments.api import Reply, Tools, register_environment
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.math_answers import extract_answer

_BLOCK = re.compile(r"```(?:python|py)[ \t]*\r?\n(.*?)```", re.S)
INSTRUCTIONS = (
    "You can run Python: write a ```python code block and end your message there; what it "
    "prints comes back to you. When you know the result, give the final answer as: Answer: <answer>"
)


def tool_call(answer: str) -> str | None:
    """The code of the turn's tool call: its last complete ```python block, when no final
    answer follows it; else None."""
    blocks = list(_BLOCK.finditer(answer))
    if not blocks or extract_answer(answer[blocks[-1].end() :]) is not None:
        return None
    return blocks[-1].group(1)


def tool_output(verdict: Verdict) -> str:
    """The user turn that returns a run's result to the model."""
    text = verdict.detail.rstrip("\n")
    if verdict.kind is not VerdictKind.ACCEPTED:
        text = f"Error: {text}"
    return f"```output\n{text}\n```"


class PythonTool:
    """Up to ``max_turns`` turns: tool calls while turns remain, then a graded answer."""

    instructions = INSTRUCTIONS

    def __init__(self, max_turns: int):
        self.max_turns = max_turns

    def reply(self, problem: Problem, answers: Sequence[str], tools: Tools) -> Reply:
        code = tool_call(answers[-1])
        if code is not None and len(answers) < self.max_turns:
            run = tools.run(code)
            if run.kind is VerdictKind.INTERNAL_ERROR:  # says nothing of the model: no reward
                return Reply(text=None, reward=float("nan"), verdict=run)
            return Reply(text=tool_output(run), reward=0.0)
        verdict = tools.verify(problem, answers[-1])
        if verdict.kind is VerdictKind.INTERNAL_ERROR:
            return Reply(text=None, reward=float("nan"), verdict=verdict)
        return Reply(text=None, reward=1.0 if verdict.accepted else 0.0, verdict=verdict)


register_environment("python_tool", PythonTool)
