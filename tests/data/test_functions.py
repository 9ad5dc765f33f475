"""The project's own function problems (rlax_tpu/data/functions.jsonl): every reference passes its
tests in the real sandbox and a stub fails them, and the held-out split holds other tasks."""

from __future__ import annotations

import json
import os

import pytest

from rlax_tpu.config import VerifierConfig
from rlax_tpu.data.functions import FUNCTIONS_FILE, load_functions
from rlax_tpu.data.problems import DataError, UnitTestProblem
from rlax_tpu.verifiers.api import UnitTestTask
from rlax_tpu.verifiers.service import VerifierService

UID = 3_000_000 + (os.getpid() % 100_000) * 8  # a uid block of its own


@pytest.fixture(scope="module")
def splits():
    return load_functions()


def _statement(prompt: str) -> str:
    """The docstring's text before its examples."""
    doc = prompt.split('"""', 1)[1]
    return " ".join(doc.split(">>>", 1)[0].split())


def _passes(solution: UnitTestProblem, tests: UnitTestProblem) -> bool:
    """Whether ``solution``'s reference passes ``tests``'s check (our own trusted code, run here)."""
    scope: dict = {}
    try:
        exec(solution.prompt + solution.canonical_solution + "\n" + tests.test, scope)
        scope["check"](scope[solution.entry_point])
    except Exception:
        return False
    return True


def test_the_splits_are_other_tasks(splits):
    train, held_out = splits["train"], splits["held_out"]
    assert (len(train), len(held_out)) == (128, 33)  # as rlax_tpu/data/functions.py says
    assert not {p.id for p in train} & {p.id for p in held_out}
    assert not {_statement(p.prompt) for p in train} & {_statement(p.prompt) for p in held_out}
    for p in held_out:
        assert p.prompt.rstrip().endswith('"""') and p.entry_point == p.id
        # Other tests: no training function's reference passes a held-out function's tests,
        # and the reverse (no task is another renamed).
        assert not [q.id for q in train if _passes(q, p) or _passes(p, q)], p.id


def test_every_reference_passes_and_a_stub_fails_in_the_sandbox(splits, tmp_path):
    problems = splits["train"] + splits["held_out"]
    config = VerifierConfig(sandbox_uid=UID, workers=2, languages=("python",))
    tasks = []
    for p in problems:
        for body in (p.canonical_solution, "    return None\n"):
            tasks.append(UnitTestTask(code=p.prompt + body, test=p.test, entry_point=p.entry_point))
    with VerifierService(config, scratch_dir=tmp_path) as verifier:
        verdicts = verifier.verify(tasks, deadline_s=600)
    for i, p in enumerate(problems):
        right, stub = verdicts[2 * i], verdicts[2 * i + 1]
        assert right.accepted, (p.id, right.kind, right.detail)
        assert not stub.accepted, p.id


def test_a_bad_record_names_its_line(tmp_path):
    good = FUNCTIONS_FILE.read_text().splitlines()[0]
    path = tmp_path / "functions.jsonl"
    path.write_text(good + "\n" + json.dumps(json.loads(good) | {"split": "dev"}) + "\n")
    with pytest.raises(DataError, match=r"functions.jsonl.*2.*split 'dev'"):
        load_functions(path)
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(DataError, match="appears twice"):
        load_functions(path)
    path.write_text(
        good + "\n" + json.dumps({k: v for k, v in json.loads(good).items() if k != "test"})
    )
    with pytest.raises(DataError, match="not a function record"):
        load_functions(path)
    path.write_text(json.dumps(json.loads(good) | {"test": None}) + "\n")
    with pytest.raises(DataError, match="test must be strings"):
        load_functions(path)
