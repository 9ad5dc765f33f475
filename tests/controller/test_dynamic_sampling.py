"""DAPO dynamic sampling through the controller: refill rounds, the batch trimmed to size, skipped
updates, and the stop after too many of them, in both modes, with the real local components.

Rewards come from the real verifier's run but are then replaced by a seeded hash of the program
text (``HashedVerdicts``, a test fake of the reward only): a tiny random model passes no test,
and the filter needs groups with unequal rewards.
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np
import pytest

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller.ledger import GroupState
from rlax_tpu.controller.loop import NothingToLearn
from rlax_tpu.types import Verdict, VerdictKind
from tests.controller.test_scheduling import make_config, run_controller

ACCEPTED = Verdict(kind=VerdictKind.ACCEPTED, tests_total=1, tests_passed=1, score=1.0)
WRONG = Verdict(kind=VerdictKind.WRONG_ANSWER, tests_total=1, tests_passed=0, score=0.0)


class HashedVerdicts:
    """The real verifier runs every task; its verdict is then replaced: accepted iff the SHA-256
    of the program text is 0 mod 3 (so a group of 2 has unequal rewards 4 times in 9), and
    nothing is accepted until ``open`` is set."""

    def __init__(self, inner, *, open_: bool = True):
        self._inner = inner
        self.open = threading.Event()
        if open_:
            self.open.set()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def verify(self, tasks, **kwargs):
        self._inner.verify(tasks, **kwargs)
        text = [getattr(t, "code", None) or getattr(t, "response", "") for t in tasks]
        passes = [int(hashlib.sha256(x.encode()).hexdigest(), 16) % 3 == 0 for x in text]
        return [ACCEPTED if p and self.open.is_set() else WRONG for p in passes]


class Batches:
    """Records each update's batch rewards per group ([N, G]) in ``updates``, the batches in
    ``batches``."""

    def __init__(self, inner):
        self._inner, self.updates, self.batches = inner, [], []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def train_step(self, batch, **kwargs):
        self.updates.append(np.asarray(batch.rewards).reshape(-1, batch.group_size))
        self.batches.append(batch)
        return self._inner.train_step(batch, **kwargs)


def dapo_config(tmp_path, **controller):
    d = to_dict(make_config(tmp_path, **controller))
    d["algorithm"] |= dict(name="dapo", overlong_shaping="off")
    return from_dict(RunConfig, d)


def run(cfg, *, open_=True, on_event=None):
    held = {}

    def wrap(comps):
        held["verifier"] = comps.verifier = HashedVerdicts(comps.verifier, open_=open_)
        held["trainer"] = comps.trainer = Batches(comps.trainer)
        if on_event is not None:
            held["on_event"] = lambda text: on_event(text, held["verifier"])

    ctl = run_controller(cfg, wrap, on_event=lambda text: held.get("on_event", print)(text))
    return ctl, held["trainer"].updates


def check_finished(ctl, cfg):
    """Every issued group is trained or discarded with a reason; none lost."""
    originals = [k for s in GroupState for k in ctl.ledger.keys(s) if "~" not in k]
    assert len(originals) + ctl.counters.prompts_too_long == ctl.mixture.issued
    reasons = collections.Counter(
        ctl.ledger[k].reason for k in ctl.ledger.keys(GroupState.DISCARDED)
    )
    assert set(reasons) <= {"filtered", "surplus", "stale", "verifier_failed"}
    assert reasons["filtered"] == ctl.counters.groups_filtered
    assert reasons["surplus"] == ctl.counters.groups_surplus
    trained = ctl.ledger.keys(GroupState.TRAINED)
    assert len(trained) == ctl.counters.groups_trained
    eta_a = cfg.controller.acceptance_staleness
    for key in trained:
        assert 0 <= ctl.ledger[key].trained_at - ctl.ledger[key].version <= eta_a


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_refill_rounds_fill_the_batch_with_groups_that_have_something_to_learn(tmp_path, mode):
    target = 2
    cfg = dapo_config(
        tmp_path / "a", num_steps=3, prompts_per_step=target, refill_rounds=4, mode=mode
    )
    ctl, updates = run(cfg)
    assert ctl.version == 3 and len(updates) == 3
    assert ctl.counters.groups_filtered > 0
    # Throughput mode refills by admitting more groups as filtered ones leave the queue.
    assert ctl.counters.groups_refilled > 0 or mode == "throughput"
    for rewards in updates:  # no group with equal rewards is trained; never more than the batch
        assert 1 <= len(rewards) <= target
        assert (rewards.max(axis=1) > rewards.min(axis=1)).all()
    full = sum(len(r) == target for r in updates)
    assert full >= 2, [len(r) for r in updates]  # 4 rounds fill a batch of 2 at a 4/9 keep rate
    check_finished(ctl, cfg)
    if mode == "deterministic":  # refills are drawn at fixed points: a rerun trains the same
        ctl2, updates2 = run(
            dapo_config(
                tmp_path / "b", num_steps=3, prompts_per_step=target, refill_rounds=4, mode=mode
            )
        )
        assert ctl2.counters == ctl.counters
        assert all(np.array_equal(a, b) for a, b in zip(updates, updates2, strict=True))
        assert sorted(ctl2.ledger.keys(GroupState.TRAINED)) == sorted(
            ctl.ledger.keys(GroupState.TRAINED)
        )


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_an_update_with_nothing_to_learn_is_skipped_and_its_step_drawn_again(tmp_path, mode):
    cfg = dapo_config(tmp_path, num_steps=2, prompts_per_step=2, refill_rounds=1, mode=mode)
    events = []

    def on_event(text, verifier):
        events.append(text)
        if "update skipped" in text:
            verifier.open.set()  # rewards differ from now on

    ctl, updates = run(cfg, open_=False, on_event=on_event)
    assert ctl.counters.updates_skipped >= 1 and ctl.version == 2 and len(updates) == 2
    assert any("nothing to learn" in e and "update skipped" in e for e in events)
    check_finished(ctl, cfg)


def test_too_many_skipped_updates_stop_the_run_with_an_error(tmp_path):
    cfg = dapo_config(
        tmp_path,
        num_steps=2,
        prompts_per_step=2,
        refill_rounds=1,
        max_skipped_updates=1,
        pipeline_depth=0,
    )
    with pytest.raises(NothingToLearn, match="2 updates in a row had nothing to learn"):
        run(cfg, open_=False)
