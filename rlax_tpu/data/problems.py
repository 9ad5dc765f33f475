"""Problem schemas: code (Codeforces-style), unit-test (HumanEval-style) and math problems.

These are plain records; the controller turns them into prompts and verifier requests.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Literal

_frozen = dataclasses.dataclass(frozen=True, kw_only=True)

CHECKER_LANGUAGES = ("cpp", "python")


class DataError(ValueError):
    """A malformed dataset record. The message names the file and the record."""

    def __init__(self, source: str, record: int | str | None, why: str):
        self.source, self.record, self.why = source, record, why
        where = source if record is None else f"{source}, record {record}"
        super().__init__(f"{where}: {why}")


@_frozen
class TestCase:
    input: str
    output: str  # the jury's answer (a checker may accept others)


@_frozen
class Checker:
    """A testlib-protocol checker: ``checker input output answer``; exit 0 AC, 1 WA, 2 PE, 3 fail."""

    language: Literal["cpp", "python"]
    source: str

    @property
    def needs_testlib(self) -> bool:
        return '#include "testlib.h"' in self.source or "#include <testlib.h>" in self.source


@_frozen
class Solution:
    language: str  # python, cpp, rust, java
    code: str


@_frozen
class CodeProblem:
    """A stdin/stdout programming problem graded on tests (and a checker, if it has one)."""

    id: str
    title: str
    statement: str  # the full text shown to the model (legend, input/output format, examples)
    tests: tuple[TestCase, ...]
    time_limit_s: float = 2.0
    memory_limit_mb: int = 256
    checker: Checker | None = None  # None: token-wise comparison with the answer
    reference_solutions: tuple[Solution, ...] = ()
    wrong_solutions: tuple[Solution, ...] = ()
    date: str = ""  # ISO date of the contest, "" if unknown (no date split possible)
    rating: int = 0  # 0: unknown
    tags: tuple[str, ...] = ()
    source: str = ""  # dataset name
    kind: Literal["code"] = "code"

    @property
    def year(self) -> int | None:
        return dt.date.fromisoformat(self.date).year if self.date else None


@_frozen
class UnitTestProblem:
    """A function to complete, graded by running its test code (HumanEval layout)."""

    id: str
    prompt: str  # signature + docstring; the model completes the body
    entry_point: str
    test: str  # defines check(candidate)
    canonical_solution: str = ""
    source: str = ""
    kind: Literal["unit_test"] = "unit_test"


@_frozen
class MathProblem:
    id: str
    question: str
    answer: str
    source: str = ""
    kind: Literal["math"] = "math"


Problem = CodeProblem | UnitTestProblem | MathProblem


def check_problem(problem: Problem, source: str, record: int | str) -> Problem:
    """Raises DataError (naming ``source`` and ``record``) if ``problem`` cannot be graded."""
    if not problem.id:
        raise DataError(source, record, "empty problem id")
    if isinstance(problem, CodeProblem):
        if not problem.tests:
            raise DataError(source, record, f"problem {problem.id!r} has no tests")
        if problem.time_limit_s <= 0 or problem.memory_limit_mb <= 0:
            raise DataError(
                source,
                record,
                f"problem {problem.id!r} has a non-positive time or memory limit "
                f"({problem.time_limit_s} s, {problem.memory_limit_mb} MB)",
            )
        if problem.checker is not None:
            if problem.checker.language not in CHECKER_LANGUAGES:
                raise DataError(
                    source,
                    record,
                    f"problem {problem.id!r}: checker language {problem.checker.language!r} is not "
                    f"one of {CHECKER_LANGUAGES}",
                )
            if not problem.checker.source.strip():
                raise DataError(source, record, f"problem {problem.id!r} has an empty checker")
    elif isinstance(problem, UnitTestProblem):
        if not problem.test.strip() or not problem.entry_point:
            raise DataError(source, record, f"problem {problem.id!r} has no test or entry point")
    elif not problem.answer.strip():
        raise DataError(source, record, f"problem {problem.id!r} has no answer")
    return problem
