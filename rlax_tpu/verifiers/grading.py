"""Codeforces-style grading of one program (RLAX §6.1).

Round one runs the compiled program on each test input and keeps its output transiently; round two
checks that output against the jury's answer with the problem's checker (or token comparison).
Tests run in parallel on the worker pool, in order; as on Codeforces the verdict is the first
failing test, and tests after a known failure are skipped. A test that earns partial points (a
checker's exit code 7) does not stop grading: the score is the mean of the tests' points.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
from concurrent.futures import Executor
from pathlib import Path

from rlax_tpu.config import VerifierConfig
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import CodeTask, TestLinks, limit
from rlax_tpu.verifiers.checkers import Checkers, TestResult, compare_tokens
from rlax_tpu.verifiers.compiler import Compiler, Executable
from rlax_tpu.verifiers.outcomes import classify, program_limits
from rlax_tpu.verifiers.repository import Repository
from rlax_tpu.verifiers.sandbox import Limits, Mount, Sandbox


class Grader:
    def __init__(
        self,
        config: VerifierConfig,
        *,
        sandbox: Sandbox,
        compiler: Compiler,
        checkers: Checkers,
        repository: Repository,
        tests_pool: Executor,
        scratch_dir: Path,
    ):
        self._config, self._sandbox, self._compiler = config, sandbox, compiler
        self._checkers, self._repository, self._pool = checkers, repository, tests_pool
        self._scratch = Path(scratch_dir)
        self._scratch.mkdir(parents=True, exist_ok=True)

    def grade(self, task: CodeTask, cancelled: threading.Event | None = None) -> Verdict:
        problem = task.problem
        total = len(problem.tests)
        if total == 0:
            return Verdict(
                kind=VerdictKind.INTERNAL_ERROR, detail=f"{problem.problem_id} has no tests"
            )
        if task.language not in self._config.languages:  # its toolchain may serve checkers only
            return Verdict(
                kind=VerdictKind.INTERNAL_ERROR,
                tests_total=total,
                detail=f"{task.language}: not enabled for submissions (verifiers.languages = "
                f"{self._config.languages})",
            )
        missing = self._repository.missing(
            [problem.checker] * bool(problem.checker)
            + [x for t in problem.tests for x in (t.input, t.answer)]
        )
        if missing:
            return Verdict(
                kind=VerdictKind.INTERNAL_ERROR,
                detail=f"{len(missing)} link(s) not in the repository, e.g. {missing[0]}",
            )
        checker = self._checkers.prepare(problem)
        if isinstance(checker, Verdict):
            return dataclasses.replace(checker, tests_total=total)
        built = self._compiler.compile(task.language, task.code)
        if isinstance(built, Verdict):
            return dataclasses.replace(built, tests_total=total)
        cfg = self._config
        memory_mb = int(
            limit(problem.memory_limit_mb, cfg.memory_limit_mb, cfg.max_memory_limit_mb)
        )
        limits = program_limits(
            built,
            time_limit_s=limit(problem.time_limit_s, cfg.time_limit_s, cfg.max_time_limit_s),
            memory_mb=memory_mb,
            output_bytes=self._config.max_output_bytes,
            disk_bytes=self._config.disk_limit_mb << 20,
        )
        outputs = Path(tempfile.mkdtemp(prefix="outputs-", dir=self._scratch))
        stop = _FirstFailure(cancelled)
        try:
            futures = [
                self._pool.submit(
                    self._one_test, i, t, built, checker, limits, memory_mb, outputs, stop
                )
                for i, t in enumerate(problem.tests)
            ]
            results = [f.result() for f in futures]
        finally:
            shutil.rmtree(outputs, ignore_errors=True)
        return _summarize(results, total, cancelled)

    def _one_test(
        self,
        index: int,
        test: TestLinks,
        program: Executable,
        checker: Executable | None,
        limits: Limits,
        memory_mb: int,
        outputs: Path,
        stop: _FirstFailure,
    ) -> tuple[TestResult, float, int] | None:
        if stop.skip(index):
            return None
        input_path = self._repository.path(test.input)
        run = self._sandbox.run(
            program.argv(memory_mb),
            limits=limits,
            mounts=[*program.mounts, Mount(input_path, "/input")],
            stdin="/input",
        )
        failure = classify(run, limits, memory_mb)
        if failure is not None:
            result = TestResult(failure[0], f"test {index + 1}: {failure[1]}", 0.0)
        else:
            answer_path = self._repository.path(test.answer)
            if checker is None:
                result = compare_tokens(run.stdout, answer_path.read_bytes())
            else:
                output_path = outputs / f"{index}.out"
                output_path.write_bytes(run.stdout)
                output_path.chmod(0o444)
                result = self._checkers.check(checker, input_path, output_path, answer_path)
            if result.kind is not VerdictKind.ACCEPTED:
                result = TestResult(result.kind, f"test {index + 1}: {result.detail}", result.score)
        if result.kind is not VerdictKind.ACCEPTED and result.score == 0.0:
            stop.failed(index)  # partial points go on: a points problem sums over its tests
        return result, run.cpu_time_s, run.max_rss_bytes


class _FirstFailure:
    """Lets tests after the first known failure (or after cancellation) skip their runs."""

    def __init__(self, cancelled: threading.Event | None):
        self._lock = threading.Lock()
        self._first: int | None = None
        self._cancelled = cancelled

    def failed(self, index: int) -> None:
        with self._lock:
            if self._first is None or index < self._first:
                self._first = index

    def skip(self, index: int) -> bool:
        if self._cancelled is not None and self._cancelled.is_set():
            return True
        with self._lock:
            return self._first is not None and index > self._first


def _summarize(
    results: list[tuple[TestResult, float, int] | None],
    total: int,
    cancelled: threading.Event | None,
) -> Verdict:
    time_s = max((r[1] for r in results if r), default=0.0)
    memory = max((r[2] for r in results if r), default=0)
    passed = 0  # accepted tests before the first that was not
    score = 0.0  # the mean over all tests: skipped ones count 0
    first: TestResult | None = None
    for r in results:
        if r is None:  # tests are skipped only after a failure without points, or on a deadline
            return Verdict(
                kind=VerdictKind.INTERNAL_ERROR,
                detail="cancelled (deadline exceeded)",
                time_s=time_s,
                memory_bytes=memory,
                tests_passed=passed,
                tests_total=total,
            )
        test, _, _ = r
        score += test.score
        if test.kind is VerdictKind.ACCEPTED:
            passed += first is None
            continue
        first = first or test
        if test.score == 0.0:  # later tests were skipped
            break
    if first is not None:
        return Verdict(
            kind=first.kind,
            detail=first.detail,
            time_s=time_s,
            memory_bytes=memory,
            tests_passed=passed,
            tests_total=total,
            score=score / total,
        )
    return Verdict(
        kind=VerdictKind.ACCEPTED,
        time_s=time_s,
        memory_bytes=memory,
        tests_passed=total,
        tests_total=total,
        score=1.0,
    )
