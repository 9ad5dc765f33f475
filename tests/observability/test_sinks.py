"""Metric sinks: a plugin's gets every record in order; one that raises, cannot open or hangs
never stops the writer; observability.sinks names only sinks that exist."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

import tests.observability.plugin_sinks as plugin
from rlax_tpu.config import ConfigError, RunConfig, from_dict
from rlax_tpu.observability import sinks as sinks_lib
from rlax_tpu.observability.metrics import MetricsWriter, read_metrics


def _recorded(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / plugin.RECORDED).read_text().splitlines()]


def test_a_plugin_sink_gets_every_record_and_table_and_a_failing_one_is_dropped_once(
    tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    with MetricsWriter(
        tmp_path, sinks=("tensorboard", "exploding", "recording", "unopenable")
    ) as w:
        for step in range(4):
            w.write(step, {"reward/mean": step / 4, "bad": float("nan")}, {"staleness": [0, step]})
        w.table(3, "samples", [{"prompt": "p", "reward": 1.0}, {"prompt": "q", "reward": 0.0}])
    got = _recorded(tmp_path)
    # In order, each as metrics.jsonl has it (a non-finite scalar is not passed on).
    assert [(r["step"], r["scalars"], r["histograms"]) for r in got[:4]] == [
        (r["step"], {"reward/mean": r["scalars"]["reward/mean"]}, r["histograms"])
        for r in read_metrics(tmp_path)
    ]
    assert got[4] == {
        "step": 3,
        "table": "samples",
        "rows": [{"prompt": "p", "reward": 1.0}, {"prompt": "q", "reward": 0.0}],
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per failing sink, not one per record
    assert any(
        "'exploding' failed (log: ConnectionError: the sink's server went away)" in m
        for m in warnings
    )
    assert any(
        "'unopenable' failed (opening: PermissionError: bad credentials" in m for m in warnings
    )
    failures = {s.name: s.failure for s in w.sinks}
    assert failures["recording"] is None and failures["tensorboard"] is None


class _Hanging:
    """A sink whose first record blocks until ``release`` is set (a network call that hangs)."""

    release = threading.Event()
    taken: list[int] = []

    def __init__(self, context: sinks_lib.SinkContext):
        pass

    def log(self, step, wall_time, scalars, histograms) -> None:
        self.taken.append(step)
        if len(self.taken) == 1:
            self.release.wait(60)

    def table(self, step, name, rows) -> None:
        pass

    def close(self) -> None:
        pass


sinks_lib.register_sink("hanging", _Hanging)


def test_a_hanging_sink_never_holds_the_writer_and_closing_waits_a_bounded_time(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    w = MetricsWriter(tmp_path, sinks=("hanging", "recording"))
    for step in range(5):
        w.write(step, {"x": float(step)})
    # Every write returned while the hanging sink still holds its first record; the other sink
    # and metrics.jsonl have them all.
    for _ in range(600):
        if _Hanging.taken:
            break
        threading.Event().wait(0.05)
    assert _Hanging.taken == [0]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(5))
    hanging = next(s for s in w.sinks if s.name == "hanging")
    hanging.close(timeout_s=0.2)
    assert any("'hanging' did not close within" in r.getMessage() for r in caplog.records)
    _Hanging.release.set()
    w.close()
    assert [r["step"] for r in _recorded(tmp_path)] == list(range(5))


def test_observability_sinks_names_only_known_sinks():
    with pytest.raises(
        ConfigError, match=r"observability.sinks.*unknown sink 'wandbb'; did you mean 'wandb'"
    ):
        from_dict(RunConfig, {"observability": {"sinks": ["tensorboard", "wandbb"]}})
    with pytest.raises(ConfigError, match=r"observability.sinks.*names a sink twice"):
        from_dict(RunConfig, {"observability": {"sinks": ["wandb", "wandb"]}})
    with pytest.raises(ConfigError, match="name the module that registers it in algorithm.plugins"):
        from_dict(RunConfig, {"observability": {"sinks": ["mlflow"]}})
    # A plugin's sink, once its module is imported (algorithm.plugins does it first).
    config = from_dict(
        RunConfig,
        {
            "algorithm": {"plugins": ["tests.observability.plugin_sinks"]},
            "observability": {"sinks": ["tensorboard", "recording"]},
        },
    )
    assert config.observability.sinks == ("tensorboard", "recording")
    assert from_dict(RunConfig, {}).observability.sinks == ("tensorboard",)
    with pytest.raises(ConfigError, match="observability.wandb.dir.*a gs:// run directory needs"):
        from_dict(
            RunConfig,
            {"controller": {"run_dir": "gs://b/run"}, "observability": {"sinks": ["wandb"]}},
        )
    with pytest.raises(ValueError, match="exists already"):
        sinks_lib.register_sink("recording", plugin.Recording)
    with pytest.raises(ValueError, match="built-in sink"):
        sinks_lib.register_sink("wandb", plugin.Recording)
