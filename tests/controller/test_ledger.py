from __future__ import annotations

import pytest

from rlax_tpu.controller.ledger import GroupState, Ledger, LedgerError


def test_life_cycle_and_counts():
    ledger = Ledger()
    for k in ("a#0", "b#0", "c#0"):
        ledger.issue(k, step=0)
    ledger.start("a#0")
    ledger.finish("a#0", version=3)
    ledger.train("a#0", at_version=4)
    ledger.start("b#0")
    ledger.requeue("b#0")  # aborted by a reload
    ledger.start("c#0")
    ledger.finish("c#0", version=0)
    ledger.issue("c#1", step=2)
    ledger.discard("c#0", reason="stale", replaced_by="c#1")
    assert ledger.counts() == {
        "issued": 2,
        "in_flight": 0,
        "buffered": 0,
        "trained": 1,
        "discarded": 1,
    }
    assert ledger.unfinished() == ["b#0", "c#1"]
    assert ledger["a#0"].trained_at == 4 and ledger["c#0"].reason == "stale"
    ledger.check(["a#0", "b#0", "c#0", "c#1"])


@pytest.mark.parametrize(
    "actions, message",
    [
        (lambda g: g.issue("a#0"), "issued twice"),
        (lambda g: g.train("a#0", at_version=1), "issued -> trained is not allowed"),
        (
            lambda g: (
                g.start("a#0"),
                g.finish("a#0", version=0),
                g.train("a#0", at_version=0),
                g.train("a#0", at_version=1),
            ),
            "trained -> trained is not allowed",
        ),
        (lambda g: g.start("zz#0"), "unknown group 'zz#0'"),
    ],
)
def test_impossible_transitions_raise(actions, message):
    ledger = Ledger()
    ledger.issue("a#0")
    with pytest.raises(LedgerError, match=message):
        actions(ledger)


def test_check_finds_lost_groups_and_dangling_replacements():
    ledger = Ledger()
    ledger.issue("a#0")
    with pytest.raises(LedgerError, match="missing from the ledger"):
        ledger.check(["a#0", "b#0"])
    ledger.discard("a#0", reason="filtered", replaced_by="a#1")
    with pytest.raises(LedgerError, match="replaced by unknown group 'a#1'"):
        ledger.check(["a#0"])


def test_state_round_trip():
    ledger = Ledger()
    ledger.issue("a#0", step=1)
    ledger.start("a#0")
    ledger.finish("a#0", version=1)
    restored = Ledger.from_state(ledger.state())
    assert restored.state() == ledger.state()
    assert restored["a#0"].state is GroupState.BUFFERED


def test_finished_groups_leave_the_live_state_once_each():
    ledger = Ledger()
    for key in ("a#0", "b#0", "c#0"):
        ledger.issue(key, step=0)
        ledger.start(key)
        ledger.finish(key, version=0)
    ledger.train("a#0", at_version=0)
    ledger.discard("b#0", reason="filtered")
    closed = ledger.take_closed()
    assert [(r["key"], r["state"]) for r in closed] == [("a#0", "trained"), ("b#0", "discarded")]
    assert ledger.take_closed() == []  # each closed group is handed out once
    assert [r["key"] for r in ledger.live_state()] == ["c#0"]
    ledger.train("c#0", at_version=1)
    assert [r["key"] for r in ledger.take_closed()] == ["c#0"] and ledger.live_state() == []
