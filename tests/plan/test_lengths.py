"""Length distributions for the planner: the factors a group draws, lognormal draws, a run's own
groups, and the flag's spelling."""

from __future__ import annotations

import statistics

import pytest

from rlax_tpu.observability.metrics import MetricsWriter
from rlax_tpu.plan.lengths import GroupLengths, fixed, from_run, lognormal, parse


def test_a_groups_factors_are_its_mean_and_longest_over_the_overall_mean():
    lengths = GroupLengths(((10.0, 30.0), (20.0, 20.0)), "two groups")
    assert lengths.mean == 20
    assert lengths.factors() == [(1.0, 1.5), (1.0, 1.0)]
    assert fixed().factors() == [(1.0, 1.0)]
    # Two groups started together end with the slower: 1.5 unless both draws are the second.
    assert 1.0 < lengths.expected_max_latency(2, trials=2000) < 1.5
    assert lengths.expected_max_latency(1, trials=2000) == pytest.approx(1.25, abs=0.03)
    with pytest.raises(ValueError, match="lengths > 0"):
        GroupLengths(((0.0,),), "empty")


def test_lognormal_lengths_have_the_mean_and_spread_asked_and_respect_the_budget():
    drawn = lognormal(100.0, 0.5, 8, cap=1e9, seed=1)
    samples = [x for g in drawn.groups for x in g]
    assert statistics.fmean(samples) == pytest.approx(100, rel=0.03)
    assert statistics.pstdev(samples) / statistics.fmean(samples) == pytest.approx(0.5, rel=0.08)
    cut = lognormal(100.0, 1.0, 8, cap=150.0, seed=1)
    assert max(x for g in cut.groups for x in g) == 150.0
    # Eight samples a group: the longest is well past the mean, the group's mean near it.
    occupancy, latency = zip(*drawn.factors(), strict=True)
    assert statistics.fmean(occupancy) == pytest.approx(1.0, abs=0.02)
    assert statistics.fmean(latency) > 1.6
    assert lognormal(100.0, 0.0, 4, cap=200.0).factors()[0] == pytest.approx((1.0, 1.0))


def test_a_runs_groups_are_its_trained_lengths_g_at_a_time(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"time/train": 1.0}, {"lengths/trained": [1.0, 3.0, 2.0, 2.0]})
    writer.write(2, {"time/train": 1.0}, {"lengths/trained": [4.0, 4.0]})
    writer.close()
    assert from_run(tmp_path, 2).groups == ((1.0, 3.0), (2.0, 2.0), (4.0, 4.0))
    assert from_run(tmp_path, 2, skip=1).groups == ((4.0, 4.0),)  # after the first step
    with pytest.raises(ValueError, match="not whole groups of 3"):
        from_run(tmp_path, 3)
    with pytest.raises(ValueError, match="no lengths/trained"):
        from_run(tmp_path / "nothing", 2)


def test_the_flags_spelling(tmp_path):
    assert parse("fixed", mean=10, group_size=4, cap=20) == fixed()
    assert "CV 0.3" in parse("lognormal:0.3", mean=10, group_size=4, cap=20).describe
    for bad in ("lognormal", "lognormal:x", "gamma:1", "fixed:1"):
        with pytest.raises(ValueError):
            parse(bad, mean=10, group_size=4, cap=20)
