"""Pre-filtering (data.prefilter_*) through the controller, with the real local components: the
training problems are measured once at version 0, and only partially solved ones are drawn."""

from __future__ import annotations

import json

import pytest

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller.ledger import GroupState
from rlax_tpu.controller.loop import PREFILTER_FILE, NothingToLearn
from tests.controller.test_dynamic_sampling import HashedVerdicts
from tests.controller.test_scheduling import make_config, run_controller


def prefilter_config(run_dir, num_steps: int) -> RunConfig:
    d = to_dict(make_config(run_dir, num_steps=num_steps, prompts_per_step=2))
    d["data"] |= dict(prefilter_samples=4, prefilter_problems=6)
    return from_dict(RunConfig, d)


def run(cfg, *, open_=True):
    events = []

    def wrap(comps):
        comps.verifier = HashedVerdicts(comps.verifier, open_=open_)

    return run_controller(cfg, wrap, on_event=events.append), events


def test_only_partially_solved_problems_are_trained_and_a_resume_keeps_the_choice(tmp_path):
    ctl, events = run(prefilter_config(tmp_path, num_steps=2))
    result = json.loads((tmp_path / PREFILTER_FILE).read_text())
    rates = result["pass_rates"]
    assert 0 < len(rates) <= 12  # at most 6 of each of the two datasets
    assert set(result["kept"]) == {k for k, r in rates.items() if 0 < r < 1}
    assert set(result["dropped_unsolved"]) == {k for k, r in rates.items() if r == 0}
    assert set(result["dropped_solved"]) == {k for k, r in rates.items() if r == 1}
    assert result["kept"] and result["dropped_unsolved"]  # the hash passes 1 in 3 samples
    for r in rates.values():
        assert r * 4 == int(r * 4)  # a count of 4 samples
    drawn = {k.split("#")[0] for s in GroupState for k in ctl.ledger.keys(s)}
    assert drawn and drawn <= set(result["kept"])
    assert any("pre-filtering" in e and "kept" in e for e in events)
    # A resume (more steps) uses the recorded choice: no second measurement.
    ctl2, events2 = run(prefilter_config(tmp_path, num_steps=3))
    assert ctl2.version == 3 and not any("pre-filtering" in e for e in events2)
    drawn2 = {k.split("#")[0] for s in GroupState for k in ctl2.ledger.keys(s)}
    assert drawn2 <= set(result["kept"])


def test_a_prefilter_that_keeps_nothing_stops_with_an_error(tmp_path):
    with pytest.raises(NothingToLearn, match="pre-filtering kept no training problem"):
        run(prefilter_config(tmp_path, num_steps=1), open_=False)
    assert not (tmp_path / PREFILTER_FILE).exists()
