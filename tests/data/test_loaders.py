"""Loaders on small fixtures written in the public datasets' field layouts."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlax_tpu.data.loaders import (
    date_split,
    load_code_contests,
    load_human_eval,
    load_open_r1_codeforces,
    load_reasoning_gym,
    read_records,
)
from rlax_tpu.data.problems import DataError


def _ts(year: int) -> int:
    return int(dt.datetime(year, 6, 1, tzinfo=dt.UTC).timestamp())


def open_r1_record(pid: str, year: int, **extra) -> dict:
    record = {
        "id": pid,
        "aliases": [pid],
        "contest_id": pid[:-1],
        "contest_name": "Round",
        "contest_type": "CF",
        "contest_start": _ts(year),
        "contest_start_year": year,
        "index": pid[-1],
        "time_limit": 1.0,
        "memory_limit": 256.0,
        "title": f"Problem {pid}",
        "description": "Print the sum of a and b.",
        "input_format": "Two integers a and b.",
        "output_format": "One integer.",
        "interaction_format": None,
        "note": "Easy.",
        "examples": [{"input": "1 2\n", "output": "3\n"}],
        "editorial": None,
        "rating": 800,
        "tags": ["math"],
        "testset_size": 2,
        "official_tests": [
            {"input": "1 2\n", "output": "3\n"},
            {"input": "5 5\n", "output": "10\n"},
        ],
        "official_tests_complete": True,
        "input_mode": "stdio",
        "generated_checker": None,
        "executable": True,
        "generated_tests": 0,
    }
    record.update(extra)
    return record


def code_contests_record(name: str, **extra) -> dict:
    record = {
        "name": name,
        "description": "Sum two numbers.",
        "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
        "private_tests": {"input": ["2 2\n"], "output": ["4\n"]},
        "generated_tests": {"input": ["0 0\n"], "output": ["0\n"]},
        "source": 2,
        "difficulty": 7,
        "solutions": {
            "language": [3, 2],
            "solution": ["print(sum(map(int,input().split())))", "int main(){}"],
        },
        "incorrect_solutions": {"language": [3], "solution": ["print(0)"]},
        "cf_contest_id": 1,
        "cf_index": "A",
        "cf_points": 500.0,
        "cf_rating": 800,
        "cf_tags": ["math"],
        "is_description_translated": False,
        "untranslated_description": "",
        "time_limit": {"seconds": 2, "nanos": 500000000},
        "memory_limit_bytes": 268435456,
        "input_file": "",
        "output_file": "",
    }
    record.update(extra)
    return record


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_open_r1_jsonl_and_parquet_agree(tmp_path: Path):
    records = [
        open_r1_record("1A", 2023),
        open_r1_record("2000B", 2024, generated_checker="#include <cstdio>\nint main(){}"),
    ]
    from_jsonl = load_open_r1_codeforces(write_jsonl(tmp_path / "cf.jsonl", records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "cf.parquet")
    from_parquet = load_open_r1_codeforces(tmp_path / "cf.parquet")
    assert from_jsonl == from_parquet
    first, second = from_jsonl
    assert first.id == "1A" and first.date == "2023-06-01" and first.year == 2023
    assert [t.output for t in first.tests] == ["3\n", "10\n"]
    assert "Print the sum" in first.statement and "Example 1\nInput:\n1 2\n" in first.statement
    assert first.time_limit_s == 1.0 and first.memory_limit_mb == 256 and first.checker is None
    assert second.checker is not None and second.checker.language == "cpp"


def test_open_r1_falls_back_to_examples_when_no_official_tests(tmp_path: Path):
    path = write_jsonl(tmp_path / "cf.jsonl", [open_r1_record("1A", 2023, official_tests=[])])
    (problem,) = load_open_r1_codeforces(path)
    assert [t.input for t in problem.tests] == ["1 2\n"]


def test_code_contests_layout(tmp_path: Path):
    (p,) = load_code_contests(
        write_jsonl(tmp_path / "cc.jsonl", [code_contests_record("1_A. Sum")])
    )
    assert [t.input for t in p.tests] == ["1 2\n", "2 2\n", "0 0\n"]
    assert p.time_limit_s == 2.5 and p.memory_limit_mb == 256
    assert [s.language for s in p.reference_solutions] == ["python", "cpp"]
    assert [s.code for s in p.wrong_solutions] == ["print(0)"]
    assert p.date == "" and p.year is None


def test_date_split_trains_up_to_year_and_tests_on_the_next(tmp_path: Path):
    records = [open_r1_record(f"{i}A", y) for i, y in enumerate([2013, 2020, 2024, 2025, 2026])]
    problems = load_open_r1_codeforces(write_jsonl(tmp_path / "cf.jsonl", records))
    train, test = date_split(problems, 2024)
    assert [p.year for p in train] == [2013, 2020, 2024]
    assert [p.year for p in test] == [2025]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": "1A"\n', "cf.jsonl, record 0: invalid JSON"),
        ("[1, 2]\n", "cf.jsonl, record 0: expected a JSON object, got list"),
    ],
)
def test_malformed_json_names_file_and_record(tmp_path: Path, content: str, message: str):
    path = tmp_path / "cf.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_open_r1_codeforces(path)


@pytest.mark.parametrize(
    "record, message",
    [
        (open_r1_record("1A", 2023, title=None), "record 1: missing field 'title'"),
        (open_r1_record("1A", 2023, title=5), "record 1: field 'title' should be str, got int"),
        (
            open_r1_record("1A", 2023, official_tests=[], examples=[]),
            "record 1: problem '1A' has no tests",
        ),
        (
            open_r1_record("1A", 2023, official_tests=[{"input": "1"}]),
            r"record 1: official_tests\[0\] needs",
        ),
        (
            open_r1_record("1A", 2023, time_limit=-1.0),
            "record 1: problem '1A' has a non-positive time",
        ),
    ],
)
def test_bad_open_r1_records(tmp_path: Path, record: dict, message: str):
    path = write_jsonl(tmp_path / "cf.jsonl", [open_r1_record("0A", 2023), record])
    with pytest.raises(DataError, match=message) as info:
        load_open_r1_codeforces(path)
    assert str(path) in str(info.value)


def test_code_contests_mismatched_tests(tmp_path: Path):
    record = code_contests_record("x", private_tests={"input": ["1"], "output": []})
    with pytest.raises(DataError, match="record 0: private_tests has 1 inputs but 0 outputs"):
        load_code_contests(write_jsonl(tmp_path / "cc.jsonl", [record]))


def test_missing_unreadable_and_unknown_files(tmp_path: Path):
    with pytest.raises(DataError, match="no such file"):
        list(read_records(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet: unreadable parquet file"):
        list(read_records(bad))
    csv = tmp_path / "x.csv"
    csv.write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        list(read_records(csv))


def test_human_eval_package_problems():
    problems = load_human_eval()
    assert len(problems) == 164
    assert problems[0].id == "HumanEval/0" and problems[0].entry_point == "has_close_elements"
    assert all(p.test and p.canonical_solution for p in problems)


def test_reasoning_gym_is_seeded_and_checkable():
    a = load_reasoning_gym("basic_arithmetic", size=5, seed=3)
    b = load_reasoning_gym("basic_arithmetic", size=5, seed=3)
    assert a == b and len(a) == 5
    for p in a:
        expression = p.question.removeprefix("Calculate ").rstrip(".")
        assert float(eval(expression)) == float(p.answer)  # noqa: S307 - trusted generator output
