"""Profiles on demand: one trace a process for every component that asks, read back with
jax.profiler (tests/controller/test_resume.py traces a run's trainer and workers)."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp

from rlax_tpu.observability.profiles import Profiler, process_name, step_dir
from tests.observability.traces import traced_programs


def test_one_trace_a_process_for_every_component_that_asks(tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    @jax.jit
    def traced_update(x):
        return jnp.sin(x) @ x

    profiler = Profiler()
    profiler.start(tmp_path, 3, "trainer")
    profiler.start(tmp_path, 3, "inference")
    profiler.start(tmp_path, 4, "inference")  # one trace at a time: named, not traced
    assert "not tracing step 4: this process traces step 3 still" in caplog.text
    traced_update(jnp.ones((8, 8))).block_until_ready()
    assert profiler.stop(tmp_path, 3, "trainer") is None  # the worker still traces
    assert profiler.stop(tmp_path, 4, "inference") is None  # never started
    where = profiler.stop(tmp_path, 3, "inference")
    assert where == step_dir(tmp_path, 3) / process_name()
    assert json.loads((where / "components.json").read_text()) == {
        "components": ["inference", "trainer"]
    }
    assert "traced_update" in traced_programs(where)
    # The next step traces anew.
    profiler.start(tmp_path, 5, "trainer")
    assert profiler.stop(tmp_path, 5, "trainer") == step_dir(tmp_path, 5) / process_name()
