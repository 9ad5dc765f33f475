"""The bundled problem set: its loader, its errors, and every solution graded by the real verifier."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rlax_tpu.config import VerifierConfig
from rlax_tpu.data.bundled import BUNDLED_DIR, expected_verdicts, load_bundled
from rlax_tpu.data.problems import CodeProblem, DataError
from rlax_tpu.verifiers.api import CodeTask
from rlax_tpu.verifiers.problems import BUNDLED_DIR as VERIFIER_PROBLEMS
from rlax_tpu.verifiers.problems import upload_problem
from rlax_tpu.verifiers.service import VerifierService


@pytest.fixture(scope="module")
def problems() -> list[CodeProblem]:
    return load_bundled()


def test_the_bundled_set(problems):
    assert len(problems) >= 30
    ids = [p.id for p in problems]
    assert len(set(ids)) == len(ids)
    with_checkers = [p for p in problems if p.checker is not None]
    assert len(with_checkers) >= 5
    for p in problems:
        assert 5 <= len(p.tests) <= 10, p.id
        assert any(s.language == "python" for s in p.reference_solutions), p.id
        assert p.wrong_solutions, p.id
        assert p.statement.startswith(p.title) and "Input\n" in p.statement, p.id
        assert "Output\n" in p.statement and "Example\n" in p.statement, p.id
        assert p.source == "bundled" and p.tags and p.rating > 0, p.id
    for p in with_checkers:
        assert p.checker is not None and not p.checker.needs_testlib, p.id
    verdicts = expected_verdicts()
    assert sorted(verdicts) == sorted(ids)
    assert all(
        v != "accepted" for p in problems for _, v in verdicts[p.id][len(p.reference_solutions) :]
    )


def test_every_file_is_used_and_ships_with_the_package():
    # pyproject's package-data ships **/*.json and **/*.cpp; anything else would be lost.
    for d in BUNDLED_DIR.iterdir():
        meta = json.loads((d / "problem.json").read_text())
        used = {"problem.json"} | ({meta["checker"]["file"]} if meta["checker"] else set())
        assert {f.name for f in d.iterdir()} == used, d.name
        assert all(name.endswith((".json", ".cpp")) for name in used), d.name


# --- broken fixtures -------------------------------------------------------------------------


def _minimal(pid: str = "tiny") -> dict:
    return {
        "id": pid,
        "title": "Tiny",
        "statement": "Print 1.",
        "time_limit_s": 1.0,
        "memory_limit_mb": 256,
        "checker": None,
        "tests": [{"input": "\n", "answer": "1\n"}],
        "solutions": [
            {"language": "python", "code": "print(1)\n", "verdict": "accepted"},
            {"language": "python", "code": "print(2)\n", "verdict": "wrong_answer"},
        ],
    }


def _write(root: Path, meta: dict | str, pid: str = "tiny") -> Path:
    (root / pid).mkdir(parents=True)
    path = root / pid / "problem.json"
    path.write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return path


def test_a_minimal_problem_loads(tmp_path):
    _write(tmp_path, _minimal())
    [problem] = load_bundled(tmp_path)
    assert problem.id == "tiny" and problem.checker is None
    assert [t.output for t in problem.tests] == ["1\n"]
    assert [s.code for s in problem.reference_solutions] == ["print(1)\n"]
    assert [s.code for s in problem.wrong_solutions] == ["print(2)\n"]
    assert [v for _, v in expected_verdicts(tmp_path)["tiny"]] == ["accepted", "wrong_answer"]


def test_a_checker_file_is_read(tmp_path):
    meta = _minimal() | {"checker": {"language": "python", "file": "check.py"}}
    path = _write(tmp_path, meta)
    (path.parent / "check.py").write_text("import sys\nsys.exit(0)\n")
    [problem] = load_bundled(tmp_path)
    assert problem.checker is not None and problem.checker.language == "python"
    assert problem.checker.source == "import sys\nsys.exit(0)\n"


def test_the_verifiers_own_fixture_problems_load():
    # Same layout as the verifier's problem files, including an inline checker source.
    problems = {p.id: p for p in load_bundled(VERIFIER_PROBLEMS)}
    assert problems["pair_with_sum"].checker is not None
    assert problems["any_divisor"].checker is not None
    assert problems["sum_of_two"].checker is None


def test_not_utf8(tmp_path):
    (tmp_path / "tiny").mkdir()
    path = tmp_path / "tiny" / "problem.json"
    path.write_bytes(b'{"id": "\xff"}')
    with pytest.raises(DataError) as e:
        load_bundled(tmp_path)
    assert str(e.value) == f"{path}, record tiny: not UTF-8 text (invalid start byte at byte 8)"


def _error(tmp_path: Path, meta: dict | str) -> tuple[Path, str]:
    path = _write(tmp_path, meta)
    with pytest.raises(DataError) as e:
        load_bundled(tmp_path)
    return path, str(e.value)


def test_malformed_json(tmp_path):
    path, message = _error(tmp_path, '{"id": "tiny",\n "title": }')
    assert message == f"{path}, record tiny: invalid JSON (Expecting value at line 2 column 11)"


def test_not_an_object(tmp_path):
    path, message = _error(tmp_path, "[1, 2]")
    assert message == f"{path}, record tiny: expected a JSON object, got list"


def test_a_missing_field(tmp_path):
    meta = _minimal()
    del meta["statement"]
    path, message = _error(tmp_path, meta)
    assert message == f"{path}, record tiny: missing field 'statement'"


def test_a_test_without_an_answer(tmp_path):
    meta = _minimal() | {"tests": [{"input": "1\n"}]}
    path, message = _error(tmp_path, meta)
    assert message == f"{path}, record tiny: missing field tests[0].'answer'"


def test_a_field_of_the_wrong_type(tmp_path):
    path, message = _error(tmp_path, _minimal() | {"time_limit_s": "1s"})
    assert message == f"{path}, record tiny: field 'time_limit_s' should be int/float, got str"


def test_a_problem_without_tests(tmp_path):
    path, message = _error(tmp_path, _minimal() | {"tests": []})
    assert message == f"{path}, record tiny: problem 'tiny' has no tests"


def test_a_missing_checker(tmp_path):
    meta = _minimal() | {"checker": {"language": "cpp", "file": "checker.cpp"}}
    path, message = _error(tmp_path, meta)
    checker = path.parent / "checker.cpp"
    assert message == f"{path}, record tiny: checker file {checker} does not exist"


def test_an_unknown_checker_language(tmp_path):
    meta = _minimal() | {"checker": {"language": "java", "file": "Checker.java"}}
    path, message = _error(tmp_path, meta)
    assert message == (
        f"{path}, record tiny: checker language 'java' is not one of ('cpp', 'python')"
    )


def test_an_unknown_verdict(tmp_path):
    meta = _minimal()
    meta["solutions"][1]["verdict"] = "wrong"
    path, message = _error(tmp_path, meta)
    assert message == f"{path}, record tiny: solutions[1] has an unknown verdict 'wrong'"


def test_an_id_that_is_not_its_directory(tmp_path):
    path, message = _error(tmp_path, _minimal("other"))
    assert message == f"{path}, record tiny: id 'other' does not match its directory name 'tiny'"


def test_a_directory_without_problem_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as e:
        load_bundled(tmp_path)
    assert str(e.value) == f"{tmp_path / 'empty' / 'problem.json'}, record empty: no such file"


def test_the_real_set_loads_from_a_copy(tmp_path):
    # The loader depends on nothing but the directory (so a copy elsewhere loads the same).
    shutil.copytree(BUNDLED_DIR, tmp_path / "set")
    assert load_bundled(tmp_path / "set") == load_bundled()


# --- every solution through the real verifier ------------------------------------------------


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    # A uid block of its own (offset 2 of this process's block of 8; tests/verifiers use 0, 4, 6).
    uid = 300_000 + (os.getpid() % 100_000) * 8 + 2
    config = VerifierConfig(
        sandbox_uid=uid,
        workers=2,
        time_limit_s=1.0,
        compile_time_limit_s=20.0,
        languages=("python", "cpp"),
    )
    with VerifierService(config, scratch_dir=tmp_path_factory.mktemp("verifier")) as service:
        yield service


def test_every_solution_gets_its_expected_verdict(verifier, problems):
    verdicts = expected_verdicts()
    tasks, expected = [], []
    for p in problems:
        spec = upload_problem(
            verifier,
            problem_id=p.id,
            tests=[(t.input, t.output) for t in p.tests],
            checker_source=p.checker.source if p.checker else "",
            checker_language=p.checker.language if p.checker else "cpp",
            time_limit_s=p.time_limit_s,
            memory_limit_mb=p.memory_limit_mb,
        )
        for i, (solution, verdict) in enumerate(verdicts[p.id]):
            tasks.append(CodeTask(problem=spec, language=solution.language, code=solution.code))
            expected.append((p.id, i, solution.language, verdict))
    results = verifier.verify(tasks)
    got = [(*e[:3], r.kind.value) for e, r in zip(expected, results, strict=True)]
    mismatches = [(g, r.detail) for g, e, r in zip(got, expected, results, strict=True) if g != e]
    assert not mismatches, mismatches
    for (_, _, _, verdict), r in zip(expected, results, strict=True):
        assert (r.tests_passed == r.tests_total) == (verdict == "accepted")


def test_checkers_run_when_submissions_are_python_only(tmp_path, problems):
    """The local preset accepts Python submissions only; problems' C++ checkers must still run
    (they once came back as internal errors, and their groups were dropped from training)."""
    uid = 1_900_000 + (os.getpid() % 100_000) * 8  # a uid block of its own
    config = VerifierConfig(
        sandbox_uid=uid,
        workers=2,
        time_limit_s=1.0,
        compile_time_limit_s=20.0,
        languages=("python",),
    )
    with_checker = [p for p in problems if p.checker is not None]
    assert len(with_checker) >= 5
    tasks = []
    with VerifierService(config, scratch_dir=tmp_path) as service:
        assert "languages: python" in service.health()
        for p in with_checker:
            spec = upload_problem(
                service,
                problem_id=p.id,
                tests=[(t.input, t.output) for t in p.tests],
                checker_source=p.checker.source,
                checker_language=p.checker.language,
                time_limit_s=p.time_limit_s,
                memory_limit_mb=p.memory_limit_mb,
            )
            [ref] = [s for s in p.reference_solutions if s.language == "python"][:1]
            tasks.append(CodeTask(problem=spec, language="python", code=ref.code))
        cpp = CodeTask(problem=tasks[0].problem, language="cpp", code="int main() {}\n")
        *verdicts, refused = service.verify([*tasks, cpp])
    assert [v.kind.value for v in verdicts] == ["accepted"] * len(tasks), [
        v.detail for v in verdicts
    ]
    assert refused.kind.value == "internal_error"
    assert "cpp: not enabled for submissions" in refused.detail
