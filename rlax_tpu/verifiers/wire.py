"""Conversions between the verifier's Python types and its protobuf messages."""

from __future__ import annotations

from rlax_tpu.rpc import verifiers_pb2 as pb
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import (
    CodeTask,
    MathTask,
    ProblemSpec,
    RunTask,
    Task,
    TestLinks,
    UnitTestTask,
    check_limits,
)


def task_to_proto(task: Task) -> pb.Task:
    if isinstance(task, CodeTask):
        p = task.problem
        problem = pb.ProblemSpec(
            problem_id=p.problem_id,
            tests=[pb.TestLinks(input=t.input, answer=t.answer) for t in p.tests],
            checker=p.checker,
            checker_language=p.checker_language,
            testlib=p.testlib,
            time_limit_s=p.time_limit_s,
            memory_limit_mb=p.memory_limit_mb,
        )
        return pb.Task(code=pb.CodeTask(problem=problem, language=task.language, code=task.code))
    if isinstance(task, UnitTestTask):
        return pb.Task(
            unit_test=pb.UnitTestTask(
                code=task.code,
                test=task.test,
                entry_point=task.entry_point,
                time_limit_s=task.time_limit_s,
            )
        )
    if isinstance(task, MathTask):
        return pb.Task(math=pb.MathTask(response=task.response, answer=task.answer))
    if isinstance(task, RunTask):
        return pb.Task(
            run=pb.RunTask(
                language=task.language,
                code=task.code,
                stdin=task.stdin,
                time_limit_s=task.time_limit_s,
            )
        )
    raise TypeError(f"not a verifier task: {type(task).__name__}")


def task_from_proto(msg: pb.Task) -> Task:
    """The task a message describes; ValueError (gRPC: INVALID_ARGUMENT) if it is malformed."""
    task = _task_from_proto(msg)
    check_limits(task)
    return task


def _task_from_proto(msg: pb.Task) -> Task:
    kind = msg.WhichOneof("kind")
    if kind == "code":
        c = msg.code
        p = c.problem
        if p.checker_language not in ("cpp", "python"):
            raise ValueError(f"checker_language must be cpp or python, got {p.checker_language!r}")
        problem = ProblemSpec(
            problem_id=p.problem_id,
            tests=tuple(TestLinks(input=t.input, answer=t.answer) for t in p.tests),
            checker=p.checker,
            checker_language=p.checker_language,  # type: ignore[arg-type]
            testlib=p.testlib,
            time_limit_s=p.time_limit_s,
            memory_limit_mb=p.memory_limit_mb,
        )
        return CodeTask(problem=problem, language=c.language, code=c.code)
    if kind == "unit_test":
        u = msg.unit_test
        return UnitTestTask(
            code=u.code, test=u.test, entry_point=u.entry_point, time_limit_s=u.time_limit_s
        )
    if kind == "math":
        return MathTask(response=msg.math.response, answer=msg.math.answer)
    if kind == "run":
        r = msg.run
        return RunTask(language=r.language, code=r.code, stdin=r.stdin, time_limit_s=r.time_limit_s)
    raise ValueError("a task must be one of code, unit_test, math or run")


def verdict_to_proto(v: Verdict) -> pb.Verdict:
    return pb.Verdict(
        kind=v.kind.value,
        detail=v.detail,
        time_s=v.time_s,
        memory_bytes=v.memory_bytes,
        tests_passed=v.tests_passed,
        tests_total=v.tests_total,
        score=v.score,
    )


def verdict_from_proto(msg: pb.Verdict) -> Verdict:
    return Verdict(
        kind=VerdictKind(msg.kind),
        detail=msg.detail,
        time_s=msg.time_s,
        memory_bytes=msg.memory_bytes,
        tests_passed=msg.tests_passed,
        tests_total=msg.tests_total,
        score=msg.score,
    )
