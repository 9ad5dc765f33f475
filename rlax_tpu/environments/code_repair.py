"""``code_repair``: the model answers a programming problem; while its program fails and
attempts remain, the verifier's verdict (which test failed and how) comes back as the next
user turn, asking for a corrected program. The turn's reward is 1 when accepted, else 0."""

from __future__ import annotations

from collections.abc import Sequence

from rlax_tpu.data.problems import Problem
from rlax_tpu.environments.api import Reply, Tools, register_environment
from rlax_tpu.types import Verdict, VerdictKind

FEEDBACK_CHARS = 600  # of the verdict's detail: a traceback's tail is what helps

_KIND = {
    VerdictKind.WRONG_ANSWER: "wrong answer",
    VerdictKind.PRESENTATION_ERROR: "presentation error",
    VerdictKind.TIME_LIMIT: "time limit exceeded",
    VerdictKind.MEMORY_LIMIT: "memory limit exceeded",
    VerdictKind.RUNTIME_ERROR: "runtime error",
    VerdictKind.COMPILE_ERROR: "compile error",
    VerdictKind.OUTPUT_LIMIT: "output limit exceeded",
}
_NO_PROGRAM = "no program in the completion"  # controller.tasks.NO_PROGRAM's detail
_ASK = "Fix it and answer with the complete corrected program in one code block."


def feedback(verdict: Verdict) -> str:
    """The user turn that reports a failed verdict to the model."""
    if verdict.kind is VerdictKind.COMPILE_ERROR and verdict.detail == _NO_PROGRAM:
        return "Your answer has no code block. Answer with the complete program in one code block."
    what = _KIND.get(verdict.kind, verdict.kind.value.replace("_", " "))
    tests = (
        f" It passed {verdict.tests_passed} of {verdict.tests_total} tests."
        if verdict.tests_total
        else ""
    )
    detail = verdict.detail.strip()
    if len(detail) > FEEDBACK_CHARS:
        detail = "..." + detail[-FEEDBACK_CHARS:]
    shown = f"\n\n{detail}" if detail else ""
    return f"Your program failed: {what}.{tests}{shown}\n\n{_ASK}"


class CodeRepair:
    """Up to ``max_turns`` attempts; the episode ends at the first accepted program."""

    def __init__(self, max_turns: int):
        self.max_turns = max_turns

    def reply(self, problem: Problem, answers: Sequence[str], tools: Tools) -> Reply:
        verdict = tools.verify(problem, answers[-1])
        if verdict.kind is VerdictKind.INTERNAL_ERROR:  # says nothing of the model: no reward
            return Reply(text=None, reward=float("nan"), verdict=verdict)
        done = verdict.accepted or len(answers) >= self.max_turns
        return Reply(
            text=None if done else feedback(verdict),
            reward=1.0 if verdict.accepted else 0.0,
            verdict=verdict,
        )


register_environment("code_repair", CodeRepair)
