"""Partial rollouts (inference.continue_on_reload) through the controller in throughput mode, with
the real local components: workers reload under running jobs, rollouts that span versions carry
per-token versions, and staleness is counted by the oldest token."""

from __future__ import annotations

import time

import pytest

from rlax_tpu.config import ConfigError, RunConfig, from_dict, to_dict
from rlax_tpu.controller.ledger import GroupState
from tests.controller.test_scheduling import make_config, run_controller


def partial_config(run_dir, **controller) -> RunConfig:
    d = to_dict(make_config(run_dir, **controller))
    d["inference"] |= dict(continue_on_reload=True, max_new_tokens=24)
    return from_dict(RunConfig, d)


class SlowSteps:
    """Test instrumentation: each engine step of the in-process worker sleeps ``s`` first, so
    generation outlasts an update and reloads land under running requests."""

    def __init__(self, worker, s: float):
        step = worker.engine.step

        def slow():
            time.sleep(s)
            return step()

        worker.engine.step = slow


class Recorded:
    """Keeps every rollout an inference worker returns."""

    def __init__(self, inner, rollouts):
        self._inner, self.rollouts = inner, rollouts

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, requests, **kwargs):
        for ro in self._inner.generate(requests, **kwargs):
            self.rollouts.append(ro)
            yield ro


def test_workers_reload_under_running_jobs_and_staleness_counts_the_oldest_token(tmp_path):
    cfg = partial_config(
        tmp_path, mode="throughput", num_steps=4, prompts_per_step=2, acceptance_staleness=3
    )
    rollouts = []

    def wrap(comps):
        SlowSteps(comps.workers[0], 0.04)
        comps.workers = [Recorded(w, rollouts) for w in comps.workers]

    ctl = run_controller(cfg, wrap)
    assert ctl.version == 4
    spanning = [ro for ro in rollouts if len(set(ro.versions.tolist())) > 1]
    assert spanning, "no rollout continued across a reload"
    for ro in spanning:  # versions only move forward within a rollout
        assert (ro.versions[1:] >= ro.versions[:-1]).all()
        assert ro.version == int(ro.versions.min())
    for key in ctl.ledger.keys(GroupState.TRAINED):
        rec = ctl.ledger[key]
        assert 0 <= rec.trained_at - rec.version <= 3  # by the oldest token


def test_partial_rollouts_need_throughput_mode(tmp_path):
    with pytest.raises(ConfigError, match="continue_on_reload.*throughput"):
        partial_config(tmp_path, mode="deterministic")
