"""Scheduling invariants under random component timings (hypothesis), around real components.

The controller runs in process against the real local components (parameter server on 127.0.0.1,
trainer, inference worker, sandboxed verifier); wrappers inject slow-downs drawn by hypothesis into
generation, verification and training. Whatever the timings: η_a is never violated, and every
prompt group the mixture issued is trained exactly once, discarded with a re-issue, filtered, or
still unfinished at the end; none is lost or trained twice.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from rlax_tpu import models
from rlax_tpu.cli import DEFAULT_CONFIG
from rlax_tpu.config import RunConfig, from_dict
from rlax_tpu.controller.app import build_prompter
from rlax_tpu.controller.components import build_local
from rlax_tpu.controller.ledger import GroupState
from rlax_tpu.controller.loop import Controller
from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.controller.throughput import choose, throughput_queue_cap
from rlax_tpu.observability.metrics import read_metrics

UID = 1_500_000 + (os.getpid() % 100_000) * 8


def make_config(run_dir: Path, **controller) -> RunConfig:
    import importlib.util

    spec = importlib.util.spec_from_file_location("cfg", DEFAULT_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("local").to_dict()
    cfg["model"] |= dict(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1
    )
    cfg["inference"] |= dict(max_new_tokens=12, max_concurrent_seqs=8)
    cfg["trainer"] |= dict(micro_batch_size=4)
    cfg["algorithm"] |= dict(group_size=2)
    cfg["data"] |= dict(eval_problems=1, eval_samples=1, eval_every=0)
    cfg["verifiers"] |= dict(workers=1, sandbox_uid=UID)
    cfg["controller"] |= (
        dict(run_dir=str(run_dir), num_steps=3, prompts_per_step=2, warmup_steps=0) | controller
    )
    return from_dict(RunConfig, cfg)


class Slow:
    """Forwards to a real component, sleeping a drawn delay before the named calls."""

    def __init__(self, inner, delays: dict[str, list[float]]):
        self._inner = inner
        self._delays = {k: itertools.cycle(v or [0.0]) for k, v in delays.items()}

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._delays:
            return attr

        def call(*args, **kwargs):
            time.sleep(next(self._delays[name]))
            return attr(*args, **kwargs)

        return call


class VaryingLengths:
    """An inference worker whose requests are capped at lengths varying 10x across prompts, with
    generation time proportional to length (long rollouts finish late, as in real RL)."""

    def __init__(self, inner, lengths: tuple[int, ...] = (1, 10), seconds_per_token: float = 0.02):
        self._inner, self.lengths, self.spt = inner, lengths, seconds_per_token

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def cap(self, key: str) -> int:
        return self.lengths[sum(key.encode()) % len(self.lengths)]

    def generate(self, requests, *, version=None):
        capped = [
            dataclasses.replace(
                r,
                sampling=dataclasses.replace(
                    r.sampling, max_new_tokens=self.cap(r.prompt_id), ignore_eos=True
                ),
            )
            for r in requests
        ]
        out = list(self._inner.generate(capped, version=version))
        time.sleep(self.spt * max((len(ro.tokens) for ro in out), default=0))
        return iter(out)


def run_controller(config: RunConfig, wrap, on_event=None) -> Controller:
    run_dir = Path(config.controller.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prompter = build_prompter(config, run_dir)  # datasets, tokenizer, prompt format
    tokenizer = prompter.tokenizer
    comps = build_local(
        config,
        model=models.load_model(config.model),
        eos_ids=tokenizer.stop_ids,
        run_dir=run_dir,
        trainer_devices=jax.devices()[:1],
    )
    try:
        wrap(comps)
        controller = Controller(
            config, comps, prompter, run_dir=run_dir, on_event=on_event or (lambda text: None)
        )
        controller.run()
    finally:
        comps.close()
    return controller


def check_ledger(ctl: Controller, *, eta_a: int, steps: int, batch: int) -> None:
    groups = {k: ctl.ledger[k] for k in ctl.ledger.keys(GroupState.TRAINED)}
    assert len(groups) == steps * batch  # each key once: a group is never trained twice
    for rec in groups.values():
        assert 0 <= rec.trained_at - rec.version <= eta_a
    for key in ctl.ledger.keys(GroupState.DISCARDED):
        rec = ctl.ledger[key]
        assert rec.reason != "stale" or rec.replaced_by in {
            k for s in GroupState for k in ctl.ledger.keys(s)
        }
    originals = [k for s in GroupState for k in ctl.ledger.keys(s) if "~" not in k]
    assert len(originals) + ctl.counters.prompts_too_long == ctl.mixture.issued  # none lost


delays = st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0]), min_size=1, max_size=4)


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(gen=delays, verify=delays, train=delays)
def test_staleness_bound_and_ledger_hold_under_random_timings(
    tmp_path_factory, mode, gen, verify, train
):
    run_dir = tmp_path_factory.mktemp("sched")
    config = make_config(run_dir, mode=mode, acceptance_staleness=1, pipeline_depth=1)

    def wrap(comps):
        comps.workers = [Slow(w, {"generate": gen}) for w in comps.workers]
        comps.verifier = Slow(comps.verifier, {"verify": verify})
        comps.trainer = Slow(comps.trainer, {"train_step": train})

    ctl = run_controller(config, wrap)
    check_ledger(ctl, eta_a=1, steps=3, batch=2)


def test_freshest_first_consumption_keeps_the_bound_and_the_ledger(tmp_path):
    """controller.consume_order = freshest_first (RLAX's order), with training slowed so that
    several versions' groups wait at once."""
    config = make_config(
        tmp_path,
        mode="throughput",
        acceptance_staleness=1,
        num_steps=3,
        prompts_per_step=2,
        consume_order="freshest_first",
    )
    ctl = run_controller(
        config, lambda c: setattr(c, "trainer", Slow(c.trainer, {"train_step": [0.5]}))
    )
    check_ledger(ctl, eta_a=1, steps=3, batch=2)


def test_an_update_takes_the_groups_the_consume_order_picks():
    """B = 2 from v5 under η_a = 2, ready groups of versions 4, 3, 5, 3 (listed out of the
    order they were buffered in: g3 first). Oldest first: the two v3, in buffered order.
    Freshest first: the two v3 too, as the next wait would discard them; without g3, g1 (v3)
    and then the freshest, g2."""
    from types import SimpleNamespace

    ready = [SimpleNamespace(key=f"g{i}", version=v) for i, v in enumerate([4, 3, 5, 3])]
    seq = {"g3": 0, "g0": 1, "g1": 2, "g2": 3}
    policy = StalenessPolicy(reload_staleness=1, acceptance_staleness=2)

    def keys(order: str, groups: list) -> list[str]:
        return [r.key for r in choose(groups, 2, 5, policy, order, seq)]

    assert keys("oldest_first", ready) == ["g3", "g1"]
    assert keys("freshest_first", ready) == ["g3", "g1"]
    assert keys("freshest_first", ready[:3]) == ["g1", "g2"]
    assert keys("oldest_first", ready[:3]) == ["g1", "g0"]


def test_a_deterministic_run_records_each_trained_groups_lengths_for_the_planner(tmp_path):
    """The planner's ``run:`` length distribution reads them: G lengths a group, in order."""
    from rlax_tpu.plan.lengths import from_run

    steps, batch = 2, 2
    config = make_config(tmp_path, num_steps=steps, prompts_per_step=batch)
    run_controller(config, lambda c: setattr(c, "workers", [VaryingLengths(w) for w in c.workers]))
    groups = from_run(tmp_path, config.algorithm.group_size).groups
    assert len(groups) == steps * batch
    # VaryingLengths caps a prompt's samples at 1 or 10 tokens: each group is one or the other.
    assert {g for g in groups} <= {(1.0,) * len(groups[0]), (10.0,) * len(groups[0])}


def test_throughput_mode_trains_long_and_short_rollouts_alike(tmp_path):
    """Lengths vary 10x and long rollouts finish late; admission control keeps the trained length
    distribution that of the generated one (discard-and-requeue alone would favour short ones)."""
    steps, batch = 6, 2
    config = make_config(
        tmp_path, mode="throughput", acceptance_staleness=1, num_steps=steps, prompts_per_step=batch
    )
    ctl = run_controller(
        config, lambda c: setattr(c, "workers", [VaryingLengths(w) for w in c.workers])
    )
    check_ledger(ctl, eta_a=1, steps=steps, batch=batch)
    import json

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = np.concatenate([r["histograms"].get("lengths/trained", []) for r in records])
    generated = np.concatenate([r["histograms"].get("lengths/generated", []) for r in records])
    assert trained.min() <= 2 and trained.max() >= 10  # both kinds are trained
    # Two-sample KS test: the trained lengths are a sample of the generated ones (α = 0.01).
    assert stats.ks_2samp(trained, generated).pvalue > 0.01
    logged = [
        r["scalars"]["groups/discarded_stale"]
        for r in records
        if "groups/discarded_stale" in r["scalars"]
    ]
    assert len(logged) == steps and logged[-1] == ctl.counters.groups_discarded_stale


def test_throughput_mode_with_unbounded_staleness_runs_with_a_bounded_queue(tmp_path):
    """acceptance_staleness = -1 (η_a = ∞): no rollout is ever too stale, and admission is capped
    by what the workers can hold plus one buffered batch instead of the (infinite) budget."""
    steps, batch = 3, 2
    config = make_config(
        tmp_path,
        mode="throughput",
        acceptance_staleness=-1,
        num_steps=steps,
        prompts_per_step=batch,
    )
    ctl = run_controller(config, lambda c: None)
    check_ledger(ctl, eta_a=steps, steps=steps, batch=batch)
    assert ctl.counters.groups_discarded_stale == 0
    assert ctl.mixture.issued <= steps * batch + throughput_queue_cap(config)


@pytest.mark.parametrize("continue_on_reload", [False, True])
def test_episodes_in_throughput_mode_keep_eta_a_and_the_ledger(tmp_path, continue_on_reload):
    """Two-turn code-repair episodes in throughput mode, with the verifier (every environment
    reply) and training slowed so that versions move on while episodes are between turns (with
    continue_on_reload a later turn may run on newer weights): an episode's version is its oldest
    token's, so every trained episode is within η_a of its update, and every group the mixture
    issued is trained once, discarded with a re-issue, or unfinished."""
    from rlax_tpu.config import to_dict
    from rlax_tpu.observability.metrics import read_metrics

    base = to_dict(make_config(tmp_path, mode="throughput", acceptance_staleness=1, num_steps=4))
    base["environment"] |= dict(name="code_repair", max_turns=2, turn_tokens=8)
    base["data"] |= dict(prompt_style="chat")
    base["inference"] |= dict(max_new_tokens=160, continue_on_reload=continue_on_reload)
    config = from_dict(RunConfig, base)

    def wrap(comps):
        comps.verifier = Slow(comps.verifier, {"verify": [0.2, 0.0, 0.05]})
        comps.trainer = Slow(comps.trainer, {"train_step": [0.6]})

    ctl = run_controller(config, wrap)
    check_ledger(ctl, eta_a=1, steps=4, batch=2)
    turns = [r["scalars"].get("episode/turns_mean") for r in read_metrics(tmp_path)]
    assert max(t for t in turns if t is not None) > 1.0  # second turns were played


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_versions_pushed_in_the_background_are_loaded_only_once_published(tmp_path, mode):
    """trainer.publish_in_flight 1 with a slow push to the parameter server (the gRPC path,
    param_server.device_versions 0): each step returns before its version is published, and
    no worker stages or loads a version before its push ended (the controller's publishes.py);
    the run and the ledger are whole."""
    config = make_config(tmp_path, mode=mode, acceptance_staleness=1, pipeline_depth=1, num_steps=3)
    config = dataclasses.replace(
        config,
        trainer=dataclasses.replace(config.trainer, publish_in_flight=1),
        param_server=dataclasses.replace(config.param_server, device_versions=0),
    )
    events: list[tuple[str, int]] = []

    class Logged:
        """Forwards to the real sink or worker, logging pushes ended and loads/stages asked."""

        def __init__(self, inner, calls):
            self._inner, self._calls = inner, calls

        def __getattr__(self, name):
            attr = getattr(self._inner, name)
            if name not in self._calls:
                return attr

            def call(version, *args, **kwargs):
                if name == "push":  # (params, version)
                    time.sleep(0.5)
                    out = attr(version, *args, **kwargs)
                    events.append(("pushed", args[0]))
                    return out
                events.append((name, version))
                return attr(version, *args, **kwargs)

            return call

    def wrap(comps):
        comps.trainer.sink = Logged(comps.trainer.sink, {"push"})
        comps.workers = [Logged(w, {"load_weights", "stage"}) for w in comps.workers]

    ctl = run_controller(config, wrap)
    check_ledger(ctl, eta_a=1, steps=3, batch=2)
    pushed = {v: k for k, (what, v) in enumerate(events) if what == "pushed"}
    assert sorted(pushed) == [0, 1, 2, 3]
    for k, (what, v) in enumerate(events):
        if what in ("load_weights", "stage"):
            assert pushed[v] < k, events
    steps = [r for r in read_metrics(tmp_path) if "trainer/publish_pending" in r["scalars"]]
    assert steps and all(r["scalars"]["trainer/publish_pending"] == 1.0 for r in steps)
