"""code_contests (its records carry no date; the dataset's own file split) trains from a config
through the controller with the real local components: training draws only train-file problems,
evaluation uses the valid/test files'."""

from __future__ import annotations

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller.ledger import GroupState
from tests.controller.test_scheduling import make_config, run_controller
from tests.data.test_loaders import code_contests_record, write_jsonl


def test_code_contests_trains_on_its_train_files_through_the_controller(tmp_path):
    data = tmp_path / "code_contests"
    data.mkdir()
    write_jsonl(
        data / "train-00000-of-00001.jsonl",
        [code_contests_record(f"{i}_A. sum {i}") for i in range(3)],
    )
    write_jsonl(data / "valid-00000-of-00001.jsonl", [code_contests_record("9_V. held out")])
    d = to_dict(make_config(tmp_path / "run", num_steps=2, prompts_per_step=2))
    d["data"] |= dict(
        datasets=("code_contests",), weights=(1.0,), data_dir=str(data), eval_problems=1
    )
    ctl = run_controller(from_dict(RunConfig, d), lambda comps: None)
    assert ctl.version == 2
    drawn = {k.split("#")[0] for s in GroupState for k in ctl.ledger.keys(s)}
    assert drawn and drawn <= {f"code_contests/{i}_A. sum {i}" for i in range(3)}
    held_out = [p.id for p in ctl.prompter.datasets.held_out]
    assert held_out == ["9_V. held out"] and ctl.evals[0]["eval/problems"] == 1.0
