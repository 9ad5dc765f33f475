from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.controller.staleness import StalenessPolicy


@pytest.mark.parametrize(
    "eta_r, depth, expected",
    [
        (1, 0, [0, 1, 2, 3, 4, 5]),  # on-policy lock-step
        (1, 1, [0, 0, 1, 2, 3, 4]),  # one-step off-policy
        (2, 1, [0, 0, 0, 2, 2, 4]),
        (4, 0, [0, 0, 0, 0, 4, 4]),
    ],
)
def test_generation_version_hand_computed(eta_r, depth, expected):
    policy = StalenessPolicy(
        reload_staleness=eta_r, acceptance_staleness=depth + eta_r - 1, pipeline_depth=depth
    )
    assert [policy.generation_version(s) for s in range(6)] == expected


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    eta_r=st.integers(1, 20),
    depth=st.integers(0, 10),
    slack=st.integers(0, 5),
    step=st.integers(0, 500),
)
def test_deterministic_schedule_respects_acceptance(eta_r, depth, slack, step):
    policy = StalenessPolicy(
        reload_staleness=eta_r, acceptance_staleness=depth + eta_r - 1 + slack, pipeline_depth=depth
    )
    g = policy.generation_version(step)
    assert g % eta_r == 0  # a reload point
    assert g <= max(0, step - depth)  # the version exists when generation starts
    assert policy.accepts(step, g)
    assert step - g <= policy.max_deterministic_staleness()


def test_acceptance():
    p = StalenessPolicy(reload_staleness=16, acceptance_staleness=32)
    assert p.accepts(40, 8) and not p.accepts(41, 8)
    assert StalenessPolicy(reload_staleness=1, acceptance_staleness=math.inf).accepts(10**9, 0)
    with pytest.raises(ValueError, match="rollout version 5 > consuming version 4"):
        p.accepts(4, 5)


def test_admission_budget_is_arealls_in_flight_bound():
    p = StalenessPolicy(reload_staleness=1, acceptance_staleness=2)
    assert p.admission_budget(batch=8, trainer_version=10, worker_version=10) == 24  # B (1 + η_a)
    assert p.admission_budget(batch=8, trainer_version=10, worker_version=9) == 16
    assert p.admission_budget(batch=8, trainer_version=10, worker_version=7) == 0
    assert p.admits(23, 8, 10, 10) and not p.admits(24, 8, 10, 10)
    assert StalenessPolicy(reload_staleness=1, acceptance_staleness=math.inf).admits(10**9, 8, 5, 0)


def test_consumption_oldest_first_or_the_freshest_after_what_would_age_out():
    """η_a = 2, the update from v5 (versions 3-5 acceptable; v3 only by this update, v4 by the
    next too)."""
    policy = StalenessPolicy(reload_staleness=1, acceptance_staleness=2)

    def take(versions: list[int], batch: int, freshest_first: bool) -> list[int]:
        picks = policy.consumption(5, versions, batch, freshest_first=freshest_first)
        return [versions[i] for i in picks]

    assert take([4, 3, 5, 3], 2, False) == [3, 3]
    # Nothing ages out unless taken now: the freshest, ties in buffered order.
    assert policy.consumption(5, [4, 5, 4, 5], 2, freshest_first=True) == [1, 3]
    # A v3 group is on its last acceptable update: it goes first, then the freshest.
    assert take([4, 3, 5], 2, True) == [3, 5]
    # More of them than the update takes: as many as fit.
    assert take([4, 3, 5, 3, 3], 2, True) == [3, 3]
    # Two v4 groups and batches of 2: update 6 can take both, so none now ...
    assert take([4, 4, 5, 5], 2, True) == [5, 5]
    # ... three cannot all wait for update 6: one now, then the freshest.
    assert take([4, 4, 4, 5, 5], 2, True) == [4, 5]
    assert policy.consumption(5, [], 2, freshest_first=True) == []
    # Unbounded: nothing ages out, freshest first is the freshest.
    unbounded = StalenessPolicy(reload_staleness=1, acceptance_staleness=math.inf)
    assert unbounded.consumption(5, [0, 5, 3], 2, freshest_first=True) == [1, 2]


def test_bad_policies():
    with pytest.raises(ValueError):
        StalenessPolicy(reload_staleness=0, acceptance_staleness=1)
    with pytest.raises(ValueError):
        StalenessPolicy(reload_staleness=1, acceptance_staleness=-1)
