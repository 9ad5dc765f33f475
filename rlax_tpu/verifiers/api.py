"""The verifier's typed API: tasks in, :class:`rlax_tpu.types.Verdict` out.

One task verifies one rollout. A Codeforces-style task carries only code and links: its tests and
checker were uploaded once to the content-addressed repository (``upload(bytes) -> link``).
``VerifierService`` (in process) and ``VerifierClient`` (gRPC) both satisfy :class:`Verifier`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, Protocol

from rlax_tpu.types import Verdict

_frozen = dataclasses.dataclass(frozen=True, kw_only=True)


@_frozen
class TestLinks:
    input: str  # repository link of the test's stdin
    answer: str  # link of the jury's answer (what a checker compares against)


@_frozen
class ProblemSpec:
    """A stdin/stdout problem as the verifier sees it: limits and links, no data."""

    problem_id: str
    tests: tuple[TestLinks, ...]
    checker: str = ""  # link of the checker's source; "" = token-wise comparison
    checker_language: Literal["cpp", "python"] = "cpp"
    testlib: str = ""  # link of a testlib.h shipped with the problem; "" = verifiers.testlib_path
    time_limit_s: float = 0.0  # per test; 0 = verifiers.time_limit_s
    memory_limit_mb: int = 0  # 0 = verifiers.memory_limit_mb


@_frozen
class CodeTask:
    """Grade a program on a problem's tests (round one: run; round two: check)."""

    problem: ProblemSpec
    language: str  # python, cpp, rust, java
    code: str


@_frozen
class UnitTestTask:
    """HumanEval style: ``code`` (prompt + completion) then ``test``, then ``check(entry_point)``."""

    code: str
    test: str
    entry_point: str = ""  # "" = ``test`` runs its asserts itself
    time_limit_s: float = 0.0  # whole program; 0 = verifiers.time_limit_s * 5


@_frozen
class MathTask:
    """Extract the final answer from ``response`` and check it is equivalent to ``answer``."""

    response: str
    answer: str


@_frozen
class RunTask:
    """Run a program on ``stdin`` and report what it printed (an environment's tool call, not a
    grade): ACCEPTED when it exits cleanly, ``Verdict.detail`` its stdout; otherwise the failure
    (time, memory, runtime error, compile error) with its output and the tail of its stderr."""

    language: str
    code: str
    stdin: str = ""
    time_limit_s: float = 0.0  # 0 = verifiers.time_limit_s


Task = CodeTask | UnitTestTask | MathTask | RunTask


def check_limits(task: Task) -> None:
    """Raises ValueError for a limit that is not a finite number >= 0 (0: the default).

    Limits above ``verifiers.max_time_limit_s`` / ``max_memory_limit_mb`` are clamped where used.
    """
    if isinstance(task, CodeTask):
        p = task.problem
        where, time_s, memory_mb = p.problem_id, p.time_limit_s, p.memory_limit_mb
    elif isinstance(task, UnitTestTask):
        where, time_s, memory_mb = "unit test", task.time_limit_s, 0
    elif isinstance(task, RunTask):
        where, time_s, memory_mb = "run", task.time_limit_s, 0
    else:
        return
    if not (isinstance(time_s, (int, float)) and math.isfinite(time_s) and time_s >= 0):
        raise ValueError(f"{where}: time_limit_s must be a finite number >= 0, got {time_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 0):
        raise ValueError(f"{where}: memory_limit_mb must be an integer >= 0, got {memory_mb!r}")


def limit(requested: float, default: float, maximum: float) -> float:
    """A request's limit: ``default`` when it gives none (0), never above ``maximum``."""
    return min(requested or default, maximum)


class Overloaded(RuntimeError):
    """More tasks than ``verifiers.max_pending`` would be in flight; retry later (backpressure)."""


class RequestTooLarge(ValueError):
    """A request (or its reply) is over the gRPC message size limit. Not transient: retrying
    the same batch fails again; send fewer tasks per call."""


BACKPRESSURE_KEY = "rlax-backpressure"  # trailing metadata that marks RESOURCE_EXHAUSTED as such


class UnknownLink(KeyError):
    """A link names nothing in the repository: upload the data first."""


class Verifier(Protocol):
    def verify(self, tasks: Sequence[Task], *, deadline_s: float | None = None) -> list[Verdict]:
        """One verdict per task, in order. Raises Overloaded beyond the pending budget."""
        ...

    def upload(self, data: bytes) -> str:
        """Stores ``data`` once; returns its link (``sha256:<hex>``)."""
        ...

    def missing(self, links: Sequence[str]) -> list[str]:
        """The links the repository does not hold (so only those need uploading)."""
        ...
