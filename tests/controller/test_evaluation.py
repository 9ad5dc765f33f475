"""Held-out evaluations beside training (controller/evaluation.py), in process against the real
local components (parameter server on 127.0.0.1, trainer, inference worker, sandboxed verifier)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jax
import pytest

from rlax_tpu import models
from rlax_tpu.controller.app import build_prompter
from rlax_tpu.controller.components import build_local
from rlax_tpu.controller.evaluation import BackgroundEvals, problems_at_once
from rlax_tpu.controller.loop import Controller
from rlax_tpu.observability.metrics import read_metrics
from tests.controller.test_scheduling import make_config, run_controller


def test_problems_at_once_is_the_share_of_every_workers_slots():
    assert problems_at_once(0.5, workers=2, slots=8, samples=2) == 4
    assert problems_at_once(1.0, workers=1, slots=8, samples=8) == 1
    assert problems_at_once(0.1, workers=1, slots=4, samples=8) == 1  # at least one


def test_background_evals_come_back_in_version_order_once_and_raise_their_failure():
    gates = {v: threading.Event() for v in (0, 5, 7)}

    def evaluate(version: int) -> dict[str, float]:
        gates[version].wait(30)
        if version == 7:
            raise RuntimeError("verifier down")
        return {"eval/pass@1": version / 10}

    evals = BackgroundEvals(evaluate)
    try:
        for v in (0, 5, 7, 5):
            evals.start(v)
        assert evals.pending() == [0, 5, 7] and evals.take_done() == []
        gates[0].set()
        gates[5].set()
        got, deadline = [], time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            got += evals.take_done()
            time.sleep(0.01)
        assert got == [(0, {"eval/pass@1": 0.0}), (5, {"eval/pass@1": 0.5})]
        assert evals.take_done() == [] and evals.pending() == [7]
        gates[7].set()
        with pytest.raises(RuntimeError, match="verifier down"):
            evals.take_done(wait=True)
        assert evals.pending() == [7]  # the failure is raised again, not lost
    finally:
        evals.close()


class HeldEvaluation:
    """A worker whose evaluation requests wait until ``release`` is set (a slow evaluation)."""

    def __init__(self, inner, release: threading.Event):
        self._inner, self.release = inner, release

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, requests, version=None):
        if any(r.prompt_id.startswith("eval/") for r in requests):
            assert self.release.wait(120), "the evaluation was never released"
        return self._inner.generate(requests, version=version)


def test_training_goes_on_while_an_evaluation_generates_and_it_is_logged_against_its_version(
    tmp_path,
):
    """Throughput mode: the evaluation of version 0 is held until the controller has logged two
    updates; it is then logged against version 0, after them, with its answers file; the final
    evaluation at the last version too. (With a blocking evaluation the run would wait forever:
    the release comes from the metrics the training writes.)"""
    config = make_config(
        tmp_path, mode="throughput", acceptance_staleness=1, num_steps=3, pipeline_depth=1
    )
    release = threading.Event()

    def watch() -> None:
        while not release.is_set():
            steps = [r["step"] for r in _records(tmp_path) if "reward/mean" in r["scalars"]]
            if len(steps) >= 2:
                release.set()
            release.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def wrap(comps):
        comps.workers = [HeldEvaluation(w, release) for w in comps.workers]

    ctl = run_controller(config, wrap)
    release.set()
    records = read_metrics(tmp_path)
    order = [
        ("eval", r["step"]) if "eval/pass@1" in r["scalars"] else ("update", r["step"])
        for r in records
        if "eval/pass@1" in r["scalars"] or "reward/mean" in r["scalars"]
    ]
    assert order.index(("eval", 0)) > order.index(("update", 2)), order
    assert ("eval", 3) in order and sorted(ctl.evals) == [0, 3]
    assert ctl.evals[0]["eval/problems"] == 1.0 and 0.0 <= ctl.evals[0]["eval/pass@1"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "eval" / "version_000000.jsonl").open()]
    assert len(rows) == config.data.eval_samples
    assert ctl.background_evals.pending() == []


def _records(run_dir):
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):
        return []


def test_a_resume_takes_logged_results_restarts_the_rest_and_names_one_it_cannot_run(tmp_path):
    """A second controller on the finished run's components and directory (as a resumed one),
    its snapshot's in-flight list set to [0, 1, 2, 7] where the metrics hold versions 0 and 1:
    those are taken as logged (not evaluated again, not logged twice); 2 is started again by
    the first ensure_versions and evaluated; 7 is neither on the parameter server nor in a
    checkpoint, and is named lost."""
    config = make_config(tmp_path, mode="deterministic", num_steps=2)
    run_dir = Path(config.controller.run_dir)
    prompter = build_prompter(config, run_dir)
    comps = build_local(
        config,
        model=models.load_model(config.model),
        eos_ids=prompter.tokenizer.stop_ids,
        run_dir=run_dir,
        trainer_devices=jax.devices()[:1],
    )
    events: list[str] = []
    try:
        first = Controller(config, comps, prompter, run_dir=run_dir, on_event=lambda t: None)
        first.run()
        logged = dict(first.evals)
        assert sorted(logged) == [0, 2]
        again = Controller(config, comps, prompter, run_dir=run_dir, on_event=events.append)
        try:
            assert again.restore()
            again.evals, again._evals_in_flight = {}, [0, 2, 7]
            metrics_before = len(read_metrics(run_dir))
            again.resume_evals()
            assert again.evals == {0: logged[0], 2: logged[2]}
            assert any("the evaluation of version 7 is lost" in e for e in events), events
            assert again._evals_in_flight == []  # 0 and 2 logged, 7 lost: nothing to start
            again._evals_in_flight = [1]
            again.ensure_versions([2])
            assert again._evals_in_flight == [] and again.background_evals.pending() == [1]
            [(version, result)] = again.background_evals.take_done(wait=True)
            assert version == 1 and result["eval/problems"] == logged[0]["eval/problems"]
            assert (run_dir / "eval" / "version_000001.jsonl").exists()
            assert len(read_metrics(run_dir)) == metrics_before  # logged by log_evals only
        finally:
            again.close()
    finally:
        comps.close()


def _records(run_dir):
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):
        return []
