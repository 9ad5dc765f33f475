"""Dataset names -> training and held-out problems: code_contests by its own file split,
reasoning-gym tasks with generator options and a held-out set of questions training never asks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlax_tpu.config import DataConfig
from rlax_tpu.data.problems import DataError
from rlax_tpu.data.sources import load_datasets

from .test_loaders import code_contests_record, write_jsonl


def _config(directory: Path) -> DataConfig:
    return DataConfig(
        datasets=("code_contests",), weights=(1.0,), data_dir=str(directory), eval_problems=8
    )


def test_code_contests_trains_on_its_train_files_and_holds_out_valid_and_test(tmp_path):
    write_jsonl(tmp_path / "train-00000-of-00002.jsonl", [code_contests_record("1_A. a")])
    write_jsonl(tmp_path / "train-00001-of-00002.jsonl", [code_contests_record("2_B. b")])
    write_jsonl(tmp_path / "valid-00000-of-00001.jsonl", [code_contests_record("3_C. c")])
    write_jsonl(tmp_path / "test-00000-of-00001.jsonl", [code_contests_record("4_D. d")])
    data = load_datasets(_config(tmp_path), seed=0)
    assert [p.id for p in data.train["code_contests"]] == ["1_A. a", "2_B. b"]
    assert sorted(p.id for p in data.held_out) == ["3_C. c", "4_D. d"]


def test_code_contests_file_outside_a_split_is_named(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [code_contests_record("1_A. a")])
    write_jsonl(tmp_path / "extra.jsonl", [code_contests_record("2_B. b")])
    with pytest.raises(DataError, match=r"code_contests file 'extra.jsonl' is not in a split"):
        load_datasets(_config(tmp_path), seed=0)


TWO_TERM_SUMS = (
    'reasoning_gym:basic_arithmetic{"min_terms": 2, "max_terms": 2, "max_digits": 2, '
    '"operators": ["+"], "allow_parentheses": false, "allow_negation": false}'
)


def _math(name: str, eval_problems: int = 24) -> DataConfig:
    return DataConfig(datasets=(name,), weights=(1.0,), eval_problems=eval_problems)


def test_reasoning_gym_options_shape_the_problems_and_held_out_questions_are_never_trained():
    data = load_datasets(_math(TWO_TERM_SUMS), seed=0)
    train = data.train[TWO_TERM_SUMS]
    for p in train + data.held_out:
        a, b = p.question.removeprefix("Calculate ").rstrip(".").split(" + ")
        assert 0 <= int(a) <= 100 and 0 <= int(b) <= 100 and int(p.answer) == int(a) + int(b)
    assert len(data.held_out) == 24
    assert len({p.question for p in data.held_out}) == 24
    assert not {p.question for p in data.held_out} & {p.question for p in train}
    assert not {p.id.rsplit("/", 2)[1] for p in data.held_out} & {"0"}  # not the training seed
    again = load_datasets(_math(TWO_TERM_SUMS), seed=0)
    assert again.held_out == data.held_out and again.train[TWO_TERM_SUMS] == train
    # Options are part of the ids: the default task's problem 0 is another problem.
    plain = load_datasets(_math("reasoning_gym:basic_arithmetic"), seed=0)
    assert plain.train["reasoning_gym:basic_arithmetic"][0].id != train[0].id


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ('{"max_digits": 2', "not JSON"),
        ("[1, 2]", "not registered"),
        ('{"no_such_field": 1}', "cannot make the dataset with options"),
    ],
)
def test_reasoning_gym_bad_options_are_named(options, error):
    with pytest.raises(DataError, match=error):
        load_datasets(_math("reasoning_gym:basic_arithmetic" + options), seed=0)


def test_a_task_too_small_for_a_held_out_split_is_an_error():
    single_digit = (
        'reasoning_gym:basic_arithmetic{"min_terms": 2, "max_terms": 2, "max_digits": 1,'
        ' "operators": ["+"], "allow_parentheses": false, "allow_negation": false}'
    )
    with pytest.raises(DataError, match="too small for a held-out split"):
        load_datasets(_math(single_digit), seed=0)
