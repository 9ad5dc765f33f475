"""The Weights & Biases sink, offline (no server here): what it writes, read back with W&B's own
record schema (tests/observability/wandb_records.py), holds metrics.jsonl's scalars and
histograms, the run's config, evaluations on their version axis and tables; a resumed writer
continues the same W&B run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlax_tpu.config import RunConfig, from_dict
from rlax_tpu.observability import wandb_sink
from rlax_tpu.observability.metrics import MetricsWriter, read_metrics
from tests.observability.wandb_records import config as wandb_config
from tests.observability.wandb_records import history, wait_finished


def offline_env(tmp: Path) -> dict[str, str]:
    """W&B offline, its caches and settings under ``tmp`` (not the home directory)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_CACHE_DIR": str(tmp / "wandb_cache"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb_config"),
        "WANDB_DATA_DIR": str(tmp / "wandb_data"),
        "WANDB_SILENT": "true",
    }


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for k, v in offline_env(tmp_path / "home").items():
        monkeypatch.setenv(k, v)


def _config(run_dir: Path) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "controller": {"run_dir": str(run_dir)},
            "observability": {
                "sinks": ["wandb"],
                "wandb": {"project": "sinks-test", "group": "g", "tags": ["a", "b"]},
            },
        },
    )


def _log(w: MetricsWriter, steps: range) -> None:
    for step in steps:
        w.write(
            step,
            {"reward/mean": 1 / (step + 1), "loss": -step * 0.25, "bad": float("inf")},
            {"staleness": [0.0, 1.0, 1.0, float(step)]},
        )


def test_an_offline_run_reads_back_as_metrics_jsonl_and_a_resume_continues_it(offline, tmp_path):
    run_dir = tmp_path / "run"
    config = _config(run_dir)
    with MetricsWriter(run_dir, sinks=("wandb",), config=config) as w:
        _log(w, range(4))
        w.write(1, {"eval/pass@1": 0.5, "eval/problems": 2.0})  # an evaluation ends late
        w.table(3, "samples", [{"prompt": "p", "reward": 1.0, "turns": ["a", "b"]}])
    assert all(s.failure is None for s in w.sinks), [s.failure for s in w.sinks]
    run_id = json.loads((run_dir / wandb_sink.RUN_FILE).read_text())["id"]
    wait_finished(run_dir)
    rows = history(run_dir)
    assert {r for r, _, _ in rows} == {run_id}
    by_step: dict[int, dict] = {}
    for _, step, row in rows:
        by_step.setdefault(step, {}).update(row)
    for record in read_metrics(run_dir):
        if "eval/pass@1" in record["scalars"]:
            continue
        row = by_step[record["step"]]
        for k, v in record["scalars"].items():
            if v is None:
                assert k not in row  # non-finite: skipped, as TensorBoard does
            else:
                assert math.isclose(row[k], v, rel_tol=0, abs_tol=0), (k, row[k], v)
        values = record["histograms"]["staleness"]
        counts, edges = np.histogram(values, bins=np.histogram_bin_edges(values, len(set(values))))
        assert row["staleness/_type"] == "histogram"
        assert row["staleness/values"] == counts.tolist()
        assert row["staleness/bins"] == edges.tolist()
    # The evaluation of version 1, logged after step 3: at the newest step, on its own axis.
    assert by_step[3]["eval/pass@1"] == 0.5 and by_step[3]["eval/version"] == 1
    assert by_step[3]["samples/_type"] == "table-file" and by_step[3]["samples/nrows"] == 1
    recorded = wandb_config(run_dir)
    assert recorded["observability"]["wandb"]["project"] == "sinks-test"
    assert recorded["controller"]["run_dir"] == str(run_dir)

    # Resumed after step 2 (a crash after step 3 was logged): the same W&B run, steps 3-5 again.
    with MetricsWriter(run_dir, resume_after_step=2, sinks=("wandb",), config=config) as w:
        _log(w, range(3, 6))
    assert all(s.failure is None for s in w.sinks), [s.failure for s in w.sinks]
    wait_finished(run_dir)
    runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in runs)
    again = [(r, s) for r, s, _ in history(run_dir)][len(rows) :]
    assert again == [(run_id, s) for s in (3, 4, 5)]


def test_a_gs_run_directory_needs_a_local_wandb_dir():
    context = wandb_sink.SinkContext(wandb_sink.storage.path("gs://bucket/run"), RunConfig(), None)
    with pytest.raises(ValueError, match="observability.wandb.dir: a gs:// run directory"):
        wandb_sink.local_dir(context)
