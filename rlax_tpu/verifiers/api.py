"""The verifier's typed API: tasks in, :class:`rlax_tpu.types.Verdict` out.

One task verifies one rollout. A Codeforces-style task carries only code and links: its tests and
checker were uploaded once to the content-addressed repository (``upload(bytes) -> link``).
``VerifierService`` (in process) and ``VerifierClient`` (gRPC) both satisfy :class:`Verifier`.
"""

from __future__ import annotations

import dataclasses
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


Task = CodeTask | UnitTestTask | MathTask


class Overloaded(RuntimeError):
    """More tasks than ``verifiers.max_pending`` would be in flight; retry later (backpressure)."""


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
