"""``--evaluate``: a run's newest version on whole datasets it never trains on, through the real
local components (trainer, parameter server, inference worker, sandboxed verifier)."""

from __future__ import annotations

import io
import json

import pytest

from rlax_tpu.controller.evaluate import evaluate_job
from rlax_tpu.controller.snapshots import SnapshotStore
from rlax_tpu.data.bundled import load_bundled
from rlax_tpu.data.problems import DataError
from rlax_tpu.types import VerdictKind
from tests.controller.test_scheduling import make_config, run_controller

KINDS = {k.value for k in VerdictKind}


def _read(run_dir, version):
    where = run_dir / "eval" / "bundled"
    answers = [json.loads(line) for line in (where / f"version_{version:06d}.jsonl").open()]
    return answers, json.loads((where / f"version_{version:06d}.json").read_text())


def test_evaluate_grades_every_problem_at_the_newest_version_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    config = make_config(run_dir, num_steps=2)
    out = io.StringIO()
    # A directory with no snapshot: the initial weights, and nothing of a run is left behind.
    before = evaluate_job(config, ["bundled"], stream=out)["bundled"]
    assert "evaluating version 0 (the initial weights" in out.getvalue()
    answers, summary = _read(run_dir, 0)
    bundled = {p.id for p in load_bundled()}
    assert summary["version"] == 0 and summary == pytest.approx(before)
    assert summary["eval/problems"] + summary["eval/too_long"] == len(bundled)
    assert {a["problem"].split(":", 1)[1] for a in answers} <= bundled
    assert len(answers) == summary["eval/problems"] * config.data.eval_samples
    assert {a["verdict"] for a in answers} <= KINDS
    # One sample per problem: pass@1 is the accepted fraction of the answers written.
    accepted = sum(a["verdict"] == "accepted" for a in answers)
    assert summary["eval/pass@1"] == pytest.approx(accepted / len(answers))
    assert SnapshotStore(run_dir / "snapshots", keep=3).steps() == []
    assert not (run_dir / "param_server").exists() or not any((run_dir / "param_server").iterdir())

    # The run trains from scratch there all the same, then the evaluation takes its version 2.
    run_controller(config, lambda comps: None)
    snapshots = SnapshotStore(run_dir / "snapshots", keep=3).steps()
    metrics = (run_dir / "metrics.jsonl").read_text()
    evaluate_job(config, ["bundled"], stream=io.StringIO())
    answers, summary = _read(run_dir, 2)
    assert summary["version"] == 2 and len(answers) == summary["eval/problems"]
    assert SnapshotStore(run_dir / "snapshots", keep=3).steps() == snapshots
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_an_unknown_dataset_fails_before_anything_is_built(tmp_path):
    config = make_config(tmp_path / "run")
    with pytest.raises(DataError, match="unknown dataset"):
        evaluate_job(config, ["no_such_set"], stream=io.StringIO())
    assert not (tmp_path / "run" / "eval").exists()
