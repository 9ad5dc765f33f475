from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlax_tpu.observability.metrics import MetricsWriter, read_metrics


def test_jsonl_and_tensorboard_agree(tmp_path: Path):
    with MetricsWriter(tmp_path) as w:
        for step in range(3):
            w.write(
                step,
                {"reward/mean": 0.5 + step, "bad": float("nan")},
                {"staleness": [0, 1, 1, 2]},
                wall_time=100.0 + step,
            )
    records = list(read_metrics(tmp_path))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["scalars"] == {"reward/mean": 1.5, "bad": None}
    assert records[2]["histograms"]["staleness"] == [0.0, 1.0, 1.0, 2.0]
    # Read the event files back with TensorBoard's own reader (an independent implementation).
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert "bad" not in acc.Tags()["scalars"]
    histo = acc.Histograms("staleness")[0].histogram_value
    assert (histo.min, histo.max, histo.num, histo.sum) == (0.0, 2.0, 4.0, 4.0)


def test_resume_drops_steps_logged_after_the_snapshot(tmp_path: Path):
    with MetricsWriter(tmp_path) as w:
        for step in range(5):
            w.write(step, {"x": step})
    with MetricsWriter(tmp_path, resume_after_step=2) as w:
        w.write(3, {"x": 30})
    assert [(r["step"], r["scalars"]["x"]) for r in read_metrics(tmp_path)] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 30),
    ]


def test_torn_last_line_is_ignored_but_corruption_elsewhere_is_not(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"step": 0, "wall_time": 0, "scalars": {}, "histograms": {}})
    path.write_text(good + "\n" + '{"step": 1, "wall')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    path.write_text('{"st\n' + good + "\n")
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        read_metrics(tmp_path)
