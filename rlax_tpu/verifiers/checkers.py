"""Round two of grading: the testlib checker protocol, or a token-wise comparison.

A checker is run as ``checker input output answer`` (sandboxed, with the three files mounted
read-only) and answers with its exit code: 0 accepted, 1 wrong answer, 2 presentation error,
3 checker failure (an internal error, not the model's), 4 "dirt" (presentation), 7 points (the
score is the first number in its message), 8 unexpected end of file (wrong answer). Checkers are
compiled once per (source, language, testlib) and cached by the compiler.

Codeforces checkers include ``testlib.h``. It is not bundled: the problem may ship one (a link),
or ``verifiers.testlib_path`` names one; otherwise such a checker is a clear internal error.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import ProblemSpec
from rlax_tpu.verifiers.compiler import Compiler, Executable
from rlax_tpu.verifiers.repository import Repository
from rlax_tpu.verifiers.sandbox import Limits, Mount, Sandbox

_INCLUDES_TESTLIB = re.compile(rb'#\s*include\s*[<"]testlib\.h[">]')
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_TESTLIB_IN_SANDBOX = "/testlib/testlib.h"
CHECKER_LIMITS = Limits(
    cpu_time_s=10.0,
    wall_time_s=20.0,
    memory_bytes=1 << 30,
    output_bytes=1 << 20,
    stack_bytes=256 << 20,
)
_EXIT_CODES = {
    0: VerdictKind.ACCEPTED,
    1: VerdictKind.WRONG_ANSWER,
    2: VerdictKind.PRESENTATION_ERROR,
    4: VerdictKind.PRESENTATION_ERROR,
    8: VerdictKind.WRONG_ANSWER,
}
_POINTS = 7


@dataclasses.dataclass(frozen=True)
class TestResult:
    kind: VerdictKind
    detail: str
    score: float  # 1 accepted, 0 failed, in between for checker points


def compare_tokens(output: bytes, answer: bytes) -> TestResult:
    """The default checker: whitespace-separated tokens must match exactly."""
    got, want = output.split(), answer.split()
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return TestResult(
                VerdictKind.WRONG_ANSWER,
                f"token {i + 1}: expected {_short(w)}, got {_short(g)}",
                0.0,
            )
    if len(got) != len(want):
        return TestResult(VerdictKind.WRONG_ANSWER, f"{len(got)} tokens, expected {len(want)}", 0.0)
    return TestResult(VerdictKind.ACCEPTED, "", 1.0)


def _short(token: bytes) -> str:
    text = token.decode(errors="replace")
    return repr(text if len(text) <= 24 else text[:21] + "...")


class Checkers:
    def __init__(self, compiler: Compiler, sandbox: Sandbox, repository: Repository, testlib: str):
        self._compiler, self._sandbox, self._repository = compiler, sandbox, repository
        self._testlib = Path(testlib) if testlib else None

    def prepare(self, problem: ProblemSpec) -> Executable | Verdict | None:
        """The problem's compiled checker; None for token comparison; a Verdict if unusable."""
        if not problem.checker:
            return None
        source = self._repository.read(problem.checker)
        flags, mounts, salt = [], [], ""
        if _INCLUDES_TESTLIB.search(source):
            if problem.testlib:
                header = self._repository.path(problem.testlib)
            elif self._testlib is not None and self._testlib.is_file():
                header = self._testlib
            else:
                return Verdict(
                    kind=VerdictKind.INTERNAL_ERROR,
                    detail=f"the checker of {problem.problem_id} includes testlib.h, but none is "
                    "available: set verifiers.testlib_path or ship testlib.h with the problem",
                )
            if problem.checker_language != "cpp":
                return Verdict(
                    kind=VerdictKind.INTERNAL_ERROR, detail="testlib.h needs a C++ checker"
                )
            flags = ["-I" + str(Path(_TESTLIB_IN_SANDBOX).parent)]
            mounts = [Mount(header, _TESTLIB_IN_SANDBOX)]
            salt = "testlib:" + str(header.stat().st_mtime_ns) + str(header)
        built = self._compiler.compile(
            problem.checker_language,
            source.decode("utf-8", errors="replace"),
            extra_flags=flags,
            extra_mounts=mounts,
            cache_salt=salt,
        )
        if isinstance(built, Verdict):  # a broken checker is the data's fault, not the model's
            return Verdict(
                kind=VerdictKind.INTERNAL_ERROR,
                detail=f"checker of {problem.problem_id} failed to compile: {built.detail[:300]}",
            )
        return built

    def check(
        self, checker: Executable, input_path: Path, output_path: Path, answer_path: Path
    ) -> TestResult:
        mounts = [
            *checker.mounts,
            Mount(input_path, "/input"),
            Mount(output_path, "/output"),
            Mount(answer_path, "/answer"),
        ]
        argv = [*checker.argv(CHECKER_LIMITS.memory_bytes >> 20), "/input", "/output", "/answer"]
        result = self._sandbox.run(argv, limits=CHECKER_LIMITS, mounts=mounts)
        message = (result.stderr or result.stdout).decode(errors="replace").strip()
        message = " ".join(message.split())[:200]
        if result.error or result.timed_out or result.exit_code is None:
            why = result.error or ("timed out" if result.timed_out else f"signal {result.signal}")
            return TestResult(VerdictKind.INTERNAL_ERROR, f"checker crashed: {why}", 0.0)
        if result.exit_code == _POINTS:
            m = _NUMBER.search(message.removeprefix("points"))
            points = min(max(float(m.group(0)), 0.0), 1.0) if m else 0.0
            kind = VerdictKind.ACCEPTED if points >= 1.0 else VerdictKind.WRONG_ANSWER
            return TestResult(kind, f"points {points:g}: {message}", points)
        kind = _EXIT_CODES.get(result.exit_code)
        if kind is None:
            return TestResult(
                VerdictKind.INTERNAL_ERROR,
                f"checker failed (exit {result.exit_code}): {message}",
                0.0,
            )
        return TestResult(kind, message, 1.0 if kind is VerdictKind.ACCEPTED else 0.0)
