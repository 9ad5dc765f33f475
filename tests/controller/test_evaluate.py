"""``--evaluate``: a run's newest version on whole datasets it never trains on, through the real
local components (trainer, parameter server, inference worker, sandboxed verifier)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil

import pytest

from rlax_tpu.controller.evaluate import directory_name, evaluate_job
from rlax_tpu.controller.snapshots import SnapshotStore
from rlax_tpu.data.bundled import load_bundled
from rlax_tpu.data.problems import DataError
from rlax_tpu.data.sources import seeded_choice
from rlax_tpu.types import VerdictKind
from tests.controller.test_scheduling import make_config, run_controller

KINDS = {k.value for k in VerdictKind}


def _read(run_dir, version):
    where = run_dir / "eval" / "bundled"
    answers = [json.loads(line) for line in (where / f"version_{version:06d}.jsonl").open()]
    return answers, json.loads((where / f"version_{version:06d}.json").read_text())


def _tree(run_dir):
    """Every file of the run directory but the evaluations', with its bytes' digest."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.relative_to(run_dir).parts[0] != "eval"
    }


def test_evaluate_grades_every_problem_at_the_version_a_resume_takes_and_changes_nothing(
    tmp_path,
):
    run_dir = tmp_path / "run"
    config = make_config(run_dir, num_steps=3)
    out = io.StringIO()
    # A directory with no snapshot: the initial weights.
    before = evaluate_job(config, ["bundled"], stream=out)["bundled"]
    assert "evaluating version 0 (the initial weights" in out.getvalue()
    assert "the run trains on it" in out.getvalue()  # the local preset trains on bundled
    answers, summary = _read(run_dir, 0)
    bundled = {p.id for p in load_bundled()}
    assert summary["version"] == 0 and summary == pytest.approx(before)
    assert summary["trained_on"] == 1.0
    assert summary["eval/problems"] + summary["eval/too_long"] == len(bundled)
    assert {a["problem"].split(":", 1)[1] for a in answers} <= bundled
    assert len(answers) == summary["eval/problems"] * config.data.eval_samples
    assert {a["verdict"] for a in answers} <= KINDS
    # One sample per problem: pass@1 is the accepted fraction of the answers written.
    accepted = sum(a["verdict"] == "accepted" for a in answers)
    assert summary["eval/pass@1"] == pytest.approx(accepted / len(answers))
    assert SnapshotStore(run_dir / "snapshots", keep=3).steps() == []

    # The run trains from scratch there all the same. Its newest trainer checkpoint lost (a
    # run stopped between a snapshot and its checkpoint): a resume would take snapshot 2 and
    # cut the logs after it; the evaluation takes version 2 and leaves every file as it was.
    run_controller(config, lambda comps: None)
    shutil.rmtree(run_dir / "trainer" / "3")
    files = _tree(run_dir)
    assert any(name.startswith("ledger") for name in files)
    out = io.StringIO()
    evaluate_job(config, ["bundled"], stream=out)
    assert "evaluating version 2 (its newest snapshot)" in out.getvalue()
    answers, summary = _read(run_dir, 2)
    assert summary["version"] == 2 and len(answers) == summary["eval/problems"]
    assert _tree(run_dir) == files


def test_a_sample_is_the_seeds_choice_of_the_dataset(tmp_path):
    config = make_config(tmp_path / "run")
    out = io.StringIO()
    m = evaluate_job(config, ["bundled"], sample=5, stream=out)["bundled"]
    assert "bundled: 5 problems (a seeded sample of 37)" in out.getvalue()
    answers, summary = _read(tmp_path / "run", 0)
    assert summary["sampled_from"] == 37 and m["eval/problems"] + m["eval/too_long"] == 5
    picked = sorted({a["problem"] for a in answers})
    chosen = seeded_choice(
        load_bundled(), 5, seed=config.controller.seed, stream="evaluate/bundled"
    )
    # The chosen problems whose prompts fit (the rest count as too long).
    assert set(picked) <= {f"bundled:{p.id}" for p in chosen}
    assert len(picked) == m["eval/problems"] > 0
    other = seeded_choice(
        load_bundled(), 5, seed=config.controller.seed + 1, stream="evaluate/bundled"
    )
    assert {p.id for p in other} != {p.id for p in chosen}  # the seed chooses
    whole = seeded_choice(load_bundled(), 37, seed=0, stream="x")
    assert [p.id for p in whole] == [p.id for p in load_bundled()]


def test_bad_requests_fail_before_anything_is_built(tmp_path):
    config = make_config(tmp_path / "run")
    with pytest.raises(DataError, match="unknown dataset"):
        evaluate_job(config, ["no_such_set"], stream=io.StringIO())
    assert not (tmp_path / "run").exists()
    short = dataclasses.replace(
        config, inference=dataclasses.replace(config.inference, max_prompt_len=4)
    )
    with pytest.raises(DataError, match="none of its 37 prompts fits"):
        evaluate_job(short, ["bundled"], stream=io.StringIO())
    nowhere = "127.0.0.1:1"
    remote = dataclasses.replace(
        config.controller,
        transport="distributed",
        verifier_endpoint=nowhere,
        trainer_endpoint=nowhere,
        param_server_endpoints=(nowhere,),
        inference_endpoints=(nowhere,),
    )
    distributed = dataclasses.replace(config, controller=remote)
    with pytest.raises(ValueError, match="must be >= 0"):
        evaluate_job(config, ["bundled"], sample=-1, stream=io.StringIO())
    with pytest.raises(ValueError, match="needs controller.transport = 'local'"):
        evaluate_job(distributed, ["bundled"], stream=io.StringIO())


def test_directory_names_are_one_component_and_distinct():
    a = directory_name('reasoning_gym:basic_arithmetic{"operators": ["+"]}')
    b = directory_name('reasoning_gym:basic_arithmetic{"operators": ["*"]}')
    assert a != b and "/" not in a and ":" not in a
    assert directory_name("human_eval") == "human_eval"
