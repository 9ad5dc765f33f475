"""The problem set written for this project: ``bundled/<id>/problem.json`` (+ a checker file).

The on-disk layout is the verifier's (``rlax_tpu.verifiers.problems``)::

    {"id": "...", "title": "...", "statement": "...", "time_limit_s": 1.0, "memory_limit_mb": 256,
     "checker": {"language": "cpp", "file": "checker.cpp"} (or "source" inline) or null,
     "tests": [{"input": "...", "answer": "..."}, ...],
     "solutions": [{"language": "python", "code": "...", "verdict": "accepted"}, ...],
     "tags": [...], "rating": 800}

Solutions whose verdict is ``accepted`` become reference solutions, the others wrong solutions;
:func:`expected_verdicts` keeps each solution's expected verdict for tests. Every malformed
problem raises :class:`DataError` naming its ``problem.json`` and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlax_tpu.data.problems import (
    CHECKER_LANGUAGES,
    Checker,
    CodeProblem,
    DataError,
    Solution,
    TestCase,
    check_problem,
)
from rlax_tpu.types import VerdictKind

BUNDLED_DIR = Path(__file__).with_name("bundled")
_VERDICTS = tuple(k.value for k in VerdictKind)


def load_bundled(directory: str | Path = BUNDLED_DIR) -> list[CodeProblem]:
    """Every problem under ``directory`` (one sub-directory each), sorted by id."""
    return [problem for problem, _ in _read_all(Path(directory))]


def expected_verdicts(directory: str | Path = BUNDLED_DIR) -> dict[str, list[tuple[Solution, str]]]:
    """Problem id -> [(solution, expected verdict value)] in file order, references included."""
    return {problem.id: verdicts for problem, verdicts in _read_all(Path(directory))}


def _read_all(directory: Path) -> list[tuple[CodeProblem, list[tuple[Solution, str]]]]:
    if not directory.is_dir():
        raise DataError(str(directory), None, "no such directory")
    # Hidden and underscore directories (caches, editors' files) are not problems.
    return [
        _read(d)
        for d in sorted(directory.iterdir())
        if d.is_dir() and not d.name.startswith((".", "_"))
    ]


def _read(problem_dir: Path) -> tuple[CodeProblem, list[tuple[Solution, str]]]:
    path = problem_dir / "problem.json"
    source, record = str(path), problem_dir.name

    def fail(why: str) -> DataError:
        return DataError(source, record, why)

    if not path.is_file():
        raise fail("no such file")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise fail(f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 text ({e.reason} at byte {e.start})") from e
    if not isinstance(meta, dict):
        raise fail(f"expected a JSON object, got {type(meta).__name__}")

    def field(
        obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str = ""
    ) -> Any:
        if name not in obj:
            raise fail(f"missing field {where}{name!r}")
        value = obj[name]
        # bool is an int in Python, but never a valid limit.
        if not isinstance(value, kind) or isinstance(value, bool):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise fail(f"field {where}{name!r} should be {names}, got {type(value).__name__}")
        return value

    pid = field(meta, "id", str)
    if pid != problem_dir.name:
        raise fail(f"id {pid!r} does not match its directory name {problem_dir.name!r}")
    tests = []
    for j, t in enumerate(field(meta, "tests", list)):
        if not isinstance(t, dict):
            raise fail(f"tests[{j}] should be an object with 'input' and 'answer'")
        tests.append(
            TestCase(
                input=field(t, "input", str, f"tests[{j}]."),
                output=field(t, "answer", str, f"tests[{j}]."),
            )
        )
    checker = None
    spec = field(meta, "checker", (dict, type(None)))
    if spec is not None:
        language = field(spec, "language", str, "checker.")
        if language not in CHECKER_LANGUAGES:
            raise fail(f"checker language {language!r} is not one of {CHECKER_LANGUAGES}")
        if "source" in spec:  # the verifier's layout also allows the source inline
            text = field(spec, "source", str, "checker.")
        else:
            checker_path = problem_dir / field(spec, "file", str, "checker.")
            if not checker_path.is_file():
                raise fail(f"checker file {checker_path} does not exist")
            text = checker_path.read_text(encoding="utf-8")
        checker = Checker(language=language, source=text)
    verdicts = []
    for j, s in enumerate(meta.get("solutions", [])):
        if not isinstance(s, dict):
            raise fail(f"solutions[{j}] should be an object")
        verdict = field(s, "verdict", str, f"solutions[{j}].")
        if verdict not in _VERDICTS:
            raise fail(f"solutions[{j}] has an unknown verdict {verdict!r}")
        solution = Solution(
            language=field(s, "language", str, f"solutions[{j}]."),
            code=field(s, "code", str, f"solutions[{j}]."),
        )
        verdicts.append((solution, verdict))
    problem = CodeProblem(
        id=pid,
        title=field(meta, "title", str),
        statement=field(meta, "statement", str),
        tests=tuple(tests),
        time_limit_s=float(field(meta, "time_limit_s", (int, float))),
        memory_limit_mb=field(meta, "memory_limit_mb", int),
        checker=checker,
        reference_solutions=tuple(s for s, v in verdicts if v == "accepted"),
        wrong_solutions=tuple(s for s, v in verdicts if v != "accepted"),
        rating=field(meta, "rating", int) if "rating" in meta else 0,
        tags=tuple(field(meta, "tags", list)) if "tags" in meta else (),
        source="bundled",
    )
    check_problem(problem, source, record)
    return problem, verdicts
