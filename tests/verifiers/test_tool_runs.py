"""Tool runs (``RunTask``): a program's stdout comes back as the verdict's detail, in the real
sandbox, in process and over gRPC on 127.0.0.1; failures say what failed with the stderr tail."""

from __future__ import annotations

import pytest

from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers.api import RunTask
from rlax_tpu.verifiers.client import VerifierClient
from rlax_tpu.verifiers.server import serve
from rlax_tpu.verifiers.tool_runs import RUN_OUTPUT_CHARS


def test_a_run_reports_its_stdout_and_reads_its_stdin(service):
    ok, echo, cpp = service.verify(
        [
            RunTask(language="python", code="print(sum(range(101)))\nprint(2 ** 100)"),
            RunTask(
                language="python", code="import sys\nprint(sys.stdin.read()[::-1])", stdin="abc"
            ),
            RunTask(language="cpp", code='#include <cstdio>\nint main(){printf("%d", 6*7);}'),
        ]
    )
    assert ok.kind is VerdictKind.ACCEPTED and ok.detail == f"5050\n{2**100}\n"
    assert echo.detail == "cba\n" and cpp.detail == "42"


def test_a_failed_run_says_why_with_its_output_and_traceback(service):
    crash, slow, syntax, loud = service.verify(
        [
            RunTask(language="python", code="print('before')\nx = 1 / 0"),
            RunTask(language="python", code="while True: pass", time_limit_s=0.5),
            RunTask(language="python", code="def f(:\n"),
            RunTask(language="python", code="print('y' * 100000)"),
        ]
    )
    assert crash.kind is VerdictKind.RUNTIME_ERROR
    assert crash.detail.startswith("exit code 1") and "before" in crash.detail
    assert crash.detail.rstrip().endswith("ZeroDivisionError: division by zero")
    assert slow.kind is VerdictKind.TIME_LIMIT
    assert syntax.kind is VerdictKind.COMPILE_ERROR
    assert loud.kind is VerdictKind.ACCEPTED and len(loud.detail) < RUN_OUTPUT_CHARS + 100
    assert loud.detail.endswith(f"({100001 - RUN_OUTPUT_CHARS} more characters)")


def test_a_run_crosses_the_wire(service):
    server, port = serve(service.config, service)
    try:
        with VerifierClient(f"127.0.0.1:{port}") as client:
            [v] = client.verify(
                [RunTask(language="python", code="print(input() * 2)", stdin="ab\n")]
            )
    finally:
        server.stop(grace=None)
    assert v.kind is VerdictKind.ACCEPTED and v.detail == "abab\n"


@pytest.mark.parametrize("limit", [-1.0, float("inf")])
def test_a_run_with_a_bad_time_limit_is_refused(service, limit):
    with pytest.raises(ValueError, match="time_limit_s"):
        service.verify([RunTask(language="python", code="print(1)", time_limit_s=limit)])
