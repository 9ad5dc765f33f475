"""The Python syntax-check helper: Python's own errors, hostile sources, privileges, restarts, and
the same verdicts as a sandbox run per program."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers.api import CodeTask
from rlax_tpu.verifiers.compiler import Compiler, compile_limits
from rlax_tpu.verifiers.problems import upload_problem
from rlax_tpu.verifiers.service import VerifierService
from rlax_tpu.verifiers.syntax_check import CheckerUnavailable, PythonSyntaxChecker

NOBODY = 65534
MAIN = "/prog/main.py"


@pytest.fixture()
def checker():
    c = PythonSyntaxChecker(uid=NOBODY, memory_bytes=1 << 30, timeout_s=20.0)
    yield c
    c.close()


def test_errors_read_as_python_reports_them(checker):
    assert checker.check(b"n = int(input())\nprint(n * 2)\n", MAIN) is None
    error = checker.check(b"print(1)\nx = (\n", MAIN)
    assert error.splitlines()[0] == f'  File "{MAIN}", line 2'
    assert error.strip().endswith("SyntaxError: '(' was never closed")
    assert "IndentationError" in checker.check(b"if True:\nprint(1)\n", MAIN)
    assert "null bytes" in checker.check(b"x = 1\x00\n", MAIN)
    # An encoding declaration is honoured, as when the interpreter reads the file.
    assert checker.check("# -*- coding: latin-1 -*-\ns = 'é'\n".encode("latin-1"), MAIN) is None


@pytest.mark.parametrize(
    "source, error",
    [
        (b"x = " + b"(" * 300 + b"1" + b")" * 300, "too many nested parentheses"),
        (b"x = " + b"-" * 100_000 + b"1", "MemoryError"),
        (b"x = 1" + b" + 1" * 200_000, "RecursionError"),
    ],
    ids=["nested-parentheses", "unary-chain", "long-sum"],
)
def test_hostile_sources_are_errors_and_the_helper_survives(checker, source, error):
    assert error in checker.check(source, MAIN)
    assert checker.check(b"print('still here')\n", MAIN) is None
    assert checker.started == 1


def test_constant_folding_does_not_blow_up(checker):
    # compile() folds constants, within CPython's size limits: no huge ints or strings get built.
    assert checker.check(b"x = 2 ** 10 ** 8\ny = 'a' * 10 ** 9\n", MAIN) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_the_helper_runs_unprivileged(checker):
    checker.check(b"pass\n", MAIN)
    status = Path(f"/proc/{checker.pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split() == [str(NOBODY)] * 4
    assert fields["Groups"].split() == []
    assert fields["NoNewPrivs"].strip() == "1"


def test_a_helper_killed_from_outside_is_replaced(checker):
    checker.check(b"pass\n", MAIN)
    first = checker.pid
    os.kill(first, 9)
    assert checker.check(b"x = (\n", MAIN).strip().endswith("'(' was never closed")
    assert checker.pid != first and checker.started == 2


def test_a_source_that_kills_the_helper_twice_is_a_compile_error():
    # 40 MiB of address space: too little for a 2 MB source's tokens and tree.
    small = PythonSyntaxChecker(uid=NOBODY, memory_bytes=40 << 20, timeout_s=20.0)
    try:
        big = b"".join(b"x%d = [%d]\n" % (i, i) for i in range(150_000))
        error = small.check(big, MAIN)
        assert error.startswith("MemoryError") or error.startswith("the syntax check died")
        assert small.check(b"pass\n", MAIN) is None
    finally:
        small.close()


def test_an_overrun_is_a_compile_error_and_the_next_check_works():
    # 0.5 s: a third of what the source takes to compile (~1.6 s), yet ample for "pass" on a
    # loaded host (a 0.05 s deadline failed CI once, when the helper's start shared it).
    slow = PythonSyntaxChecker(uid=NOBODY, memory_bytes=1 << 30, timeout_s=0.5)
    try:
        big = b"".join(b"x%d = %d\n" % (i, i) for i in range(300_000))
        assert slow.check(big, MAIN) == "the syntax check exceeded 0.5 s"
        assert slow.check(b"pass\n", MAIN) is None
        assert slow.started == 2
    finally:
        slow.close()


def test_verdicts_match_a_sandbox_run_per_program(service, verifier_config, tmp_path):
    programs = {
        "ok": "print(int(input()) * 2)\n",
        "wrong": "print(int(input()) * 3)\n",
        "syntax": "print(int(input()) * 2\n",
        "indentation": "if True:\nprint(1)\n",
        "null-byte": "print(1)\x00\n",
        "nested": "x = " + "(" * 300 + "1" + ")" * 300 + "\n",
        "runtime": "raise SystemExit(3)\n",
    }

    def verify(svc: VerifierService) -> list:
        problem = upload_problem(svc, problem_id="double", tests=[("21\n", "42\n")])
        return svc.verify(
            [CodeTask(problem=problem, language="python", code=c) for c in programs.values()]
        )

    assert service.config.python_check == "helper"
    helper = verify(service)
    config = verifier_config(2, python_check="sandbox", languages=("python",))
    with VerifierService(config, scratch_dir=tmp_path) as sandboxed:
        reference = verify(sandboxed)
    kinds = {name: v.kind for name, v in zip(programs, helper, strict=True)}
    assert kinds == {name: v.kind for name, v in zip(programs, reference, strict=True)}
    assert kinds["ok"] is VerdictKind.ACCEPTED and kinds["syntax"] is VerdictKind.COMPILE_ERROR
    for name in ("syntax", "indentation"):
        h, r = helper[list(programs).index(name)], reference[list(programs).index(name)]
        # Both end with Python's own message (the sandbox run adds the checking command's frames).
        assert h.detail.splitlines()[-1] == r.detail.splitlines()[-1]


def test_a_helper_that_cannot_start_is_an_internal_error_not_a_verdict(service, tmp_path):
    # A deadline no interpreter can start within: the helper is never ready.
    broken = PythonSyntaxChecker(
        uid=NOBODY, memory_bytes=1 << 30, timeout_s=1.0, start_timeout_s=1e-6
    )
    with pytest.raises(CheckerUnavailable, match="did not start"):
        broken.check(b"pass\n", MAIN)
    limits = compile_limits(time_limit_s=20.0, memory_mb=512, disk_bytes=64 << 20)
    compiler = Compiler(
        service.sandbox, service.toolchains, tmp_path, limits, python_checker=broken
    )
    verdict = compiler.compile("python", "print(1)\n")
    assert verdict.kind is VerdictKind.INTERNAL_ERROR and "did not start" in verdict.detail
    broken.close()
