"""Dataset names -> training and held-out problems: code_contests by its own file split."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlax_tpu.config import DataConfig
from rlax_tpu.data.problems import DataError
from rlax_tpu.data.sources import load_datasets

from .test_loaders import code_contests_record, write_jsonl


def _config(directory: Path) -> DataConfig:
    return DataConfig(datasets=("code_contests",), weights=(1.0,), data_dir=str(directory),
                      eval_problems=8)  # fmt: skip


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
