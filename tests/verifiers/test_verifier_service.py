"""The service's API over real gRPC on 127.0.0.1, backpressure, deadlines, math, the entry point."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from rlax_tpu.cli import EXIT_STOPPED
from rlax_tpu.rpc import transport
from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers import api
from rlax_tpu.verifiers.api import (
    CodeTask,
    MathTask,
    Overloaded,
    ProblemSpec,
    RequestTooLarge,
    UnitTestTask,
)
from rlax_tpu.verifiers.client import VerifierClient
from rlax_tpu.verifiers.math_answers import extract_answer
from rlax_tpu.verifiers.problems import upload_problem
from rlax_tpu.verifiers.server import serve
from rlax_tpu.verifiers.service import VerifierService

REPO = Path(__file__).resolve().parents[2]
SLEEPER = UnitTestTask(code="import time\ntime.sleep(2)\n", test="", time_limit_s=5)


@pytest.fixture(scope="module")
def endpoint(service):
    server, port = serve(service.config, service)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_grpc_round_trip_with_a_batch(endpoint):
    with VerifierClient(endpoint) as client:
        assert client.health().serving
        problem = upload_problem(
            client, problem_id="double", tests=[("2\n", "4\n"), ("5\n", "10\n")], time_limit_s=1
        )
        assert client.missing([t.input for t in problem.tests]) == []
        verdicts = client.verify(
            [
                CodeTask(problem=problem, language="python", code="print(2 * int(input()))"),
                CodeTask(
                    problem=problem,
                    language="cpp",
                    code='#include <cstdio>\nint main(){int n;scanf("%d",&n);printf("%d",n+2);}',
                ),
                UnitTestTask(
                    code="def sq(x):\n    return x * x\n",
                    test="def check(f):\n    assert f(3) == 9\n",
                    entry_point="sq",
                ),
                MathTask(response="Thus the result is \\boxed{\\frac{3}{6}}.", answer="0.5"),
                MathTask(response="The answer is 7.", answer="8"),
            ],
            deadline_s=120,
        )
    kinds = [v.kind for v in verdicts]
    assert kinds == [
        VerdictKind.ACCEPTED,
        VerdictKind.WRONG_ANSWER,
        VerdictKind.ACCEPTED,
        VerdictKind.ACCEPTED,
        VerdictKind.WRONG_ANSWER,
    ]
    assert verdicts[0].tests_passed == 2 and verdicts[1].detail.startswith("test 2:")


def test_grpc_rejects_unknown_task_shapes(endpoint):
    from rlax_tpu.rpc import verifiers_pb2 as pb
    from rlax_tpu.rpc import verifiers_pb2_grpc as pb_grpc

    stub = pb_grpc.VerifierStub(transport.make_channel(endpoint))
    with pytest.raises(grpc.RpcError) as info:
        stub.Verify(pb.VerifyRequest(tasks=[pb.Task()]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_backpressure_over_grpc(tmp_path, verifier_config):
    config = verifier_config(6, max_pending=2, languages=("python",))
    with VerifierService(config, scratch_dir=tmp_path) as svc:
        server, port = serve(config, svc)
        try:
            with VerifierClient(f"127.0.0.1:{port}") as client:
                with pytest.raises(Overloaded):  # one batch larger than the budget
                    client.verify([MathTask(response="1", answer="1")] * 3)
                busy = threading.Thread(target=svc.verify, args=([SLEEPER, SLEEPER],))
                busy.start()
                while svc.pending < 2:
                    time.sleep(0.01)
                with pytest.raises(Overloaded) as info:
                    client.verify([MathTask(response="\\boxed{1}", answer="1")])
                assert "max_pending=2" in str(info.value)
                busy.join()
                assert svc.pending == 0
                [ok] = client.verify([MathTask(response="\\boxed{1}", answer="1")])
                assert ok.accepted
        finally:
            server.stop(grace=None)


def test_deadline_gives_internal_errors_not_model_failures(service):
    [late] = service.verify([SLEEPER], deadline_s=0.5)
    assert late.kind is VerdictKind.INTERNAL_ERROR and not late.is_model_failure
    assert "deadline" in late.detail


def test_grpc_token_auth(tmp_path, verifier_config):
    token = tmp_path / "token"
    token.write_text("let-me-in\n")
    config = verifier_config(6, auth_token_file=str(token), languages=("python",))
    with VerifierService(config, scratch_dir=tmp_path / "s") as svc:
        server, port = serve(config, svc)
        try:
            creds = transport.Credentials(auth_token_file=str(token))
            with VerifierClient(f"127.0.0.1:{port}", credentials=creds) as client:
                assert client.health().serving
            with VerifierClient(f"127.0.0.1:{port}") as anonymous:
                with pytest.raises(grpc.RpcError) as info:
                    anonymous.verify([MathTask(response="1", answer="1")])
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            server.stop(grace=None)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so \\boxed{\\frac{1}{2}} and done", "\\frac{1}{2}"),
        ("\\boxed{x^{2}} then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("Final answer: 42.", "42"),
        ("blah\n#### 17", "17"),
        ("no answer here", None),
    ],
)
def test_answer_extraction(response, answer):
    assert extract_answer(response) == answer


def test_math_equivalence(service):
    pairs = [
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", True),
        ("answer: 0.25", "\\frac{1}{4}", True),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
        ("\\boxed{3}", "4", False),
        ("I give up", "4", False),
    ]
    verdicts = service.verify([MathTask(response=r, answer=a) for r, a, _ in pairs])
    assert [v.accepted for v in verdicts] == [ok for _, _, ok in pairs]


def test_python_m_verifiers_starts_and_answers(verifier_config):
    config = verifier_config(6)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.verifiers",
            "--config=configs/codeforces.py:local",
            f"--config.verifiers.sandbox_uid={config.sandbox_uid}",
            "--config.verifiers.languages=('python',)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("verifiers serving on 127.0.0.1:"), proc.stderr.read()
        endpoint = line.split()[3]
        with VerifierClient(endpoint) as client:
            [verdict] = client.verify([UnitTestTask(code="x = 1\n", test="assert x == 1\n")])
        assert verdict.accepted
        proc.terminate()
        assert proc.wait(timeout=60) == EXIT_STOPPED
        assert "verifiers stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- limits a request asks for ---------------------------------------------------------------

BAD_LIMITS = [
    UnitTestTask(code="x = 1\n", test="", time_limit_s=float("nan")),
    UnitTestTask(code="x = 1\n", test="", time_limit_s=float("inf")),
    UnitTestTask(code="x = 1\n", test="", time_limit_s=-1.0),
]


def _code_task(time_limit_s: float = 0.0, memory_limit_mb: int = 0) -> CodeTask:
    problem = ProblemSpec(
        problem_id="limits",
        tests=(api.TestLinks(input="sha256:00", answer="sha256:00"),),
        time_limit_s=time_limit_s,
        memory_limit_mb=memory_limit_mb,
    )
    return CodeTask(problem=problem, language="python", code="print(1)")


BAD_LIMITS += [_code_task(time_limit_s=float("-inf")), _code_task(memory_limit_mb=-5)]


@pytest.mark.parametrize("task", BAD_LIMITS, ids=range(len(BAD_LIMITS)))
def test_non_finite_or_negative_limits_are_invalid(task, service, endpoint):
    with pytest.raises(ValueError, match="must be a"):
        service.verify([task])
    with VerifierClient(endpoint) as client, pytest.raises(grpc.RpcError) as info:
        client.verify([task])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must be a" in info.value.details()


def test_requested_limits_are_clamped_to_the_config(tmp_path, verifier_config):
    config = verifier_config(
        6,
        languages=("python",),
        max_time_limit_s=1.0,
        memory_limit_mb=64,
        max_memory_limit_mb=128,
    )
    hog = "blocks = [bytearray(1 << 20) for _ in range(400)]\nprint(len(blocks))\n"
    with VerifierService(config, scratch_dir=tmp_path) as svc:
        problem = upload_problem(
            svc,
            problem_id="greedy",
            tests=[("", "400\n")],
            time_limit_s=1e9,
            memory_limit_mb=1 << 20,
        )
        spin = CodeTask(problem=problem, language="python", code="while True:\n    pass\n")
        [slow, big] = svc.verify([spin, CodeTask(problem=problem, language="python", code=hog)])
    assert slow.kind is VerdictKind.TIME_LIMIT and slow.detail.endswith((" 1 s", " 3 s")), slow
    assert big.kind is VerdictKind.MEMORY_LIMIT and "128 MB" in big.detail, big


def test_an_oversize_request_is_not_backpressure(endpoint, service):
    """gRPC refuses messages over its size limit with RESOURCE_EXHAUSTED too; that is permanent."""
    huge = MathTask(response="x" * (transport.DEFAULT_MAX_MESSAGE_BYTES + 1), answer="1")
    with VerifierClient(endpoint) as client:
        with pytest.raises(RequestTooLarge, match="send fewer tasks per call") as info:
            client.verify([huge])
        assert not isinstance(info.value, Overloaded)
        [ok] = client.verify([MathTask(response="\\boxed{1}", answer="1")])
    assert ok.accepted
