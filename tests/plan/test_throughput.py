"""The throughput schedule's simulator against schedules worked out by hand."""

from __future__ import annotations

import itertools
import math

import pytest

from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.plan.throughput import ThroughputCosts, simulate_throughput


def _policy(eta_a: float, eta_r: int = 1) -> StalenessPolicy:
    return StalenessPolicy(reload_staleness=eta_r, acceptance_staleness=eta_a)


COSTS = ThroughputCosts(group_s=10.0, check_s=1.0, train_s=4.0)


def test_no_staleness_admits_one_batch_at_a_time():
    """η_a = 0: the budget is B, so a batch is generated (10 + 1 s) and then trained (4 s)."""
    sched = simulate_throughput(3, COSTS, _policy(0), batch=2, slots=2)
    assert [(u.train_start, u.train_end) for u in sched.updates] == [(11, 15), (26, 30), (41, 45)]
    assert sched.seconds_per_update() == 15 and sched.staleness_counts() == {0: 6}


def test_one_step_of_staleness_overlaps_a_batch_with_each_update():
    """η_a = 1, B = 2, 4 slots. v0 admits 4 (all in by 11): update 0 [11, 15] on two, update 1
    [15, 19] on the other two (staleness 1). v1's 2 groups, admitted at 15, start at 15 (the
    worker's v0 groups are done); v2's, admitted at 19, wait for v1's to drain (the pool's
    epochs: one version at a time on a worker) and start at 25. So from then on one batch every
    10 s: updates 2, 3, ... at [26, 30], [36, 40], ..., each one version stale."""
    sched = simulate_throughput(8, COSTS, _policy(1), batch=2, slots=4)
    ends = [u.train_end for u in sched.updates]
    assert ends == [15, 19, 30, 40, 50, 60, 70, 80]
    assert sched.seconds_per_update() == pytest.approx(61 / 6)
    assert sched.staleness_counts() == {0: 2, 1: 14}
    assert [u.wait_s for u in sched.updates[:4]] == [11, 0, 7, 6]


def test_unbounded_staleness_is_held_by_the_queue_cap():
    """η_a = ∞, a queue of 3, B = 1, one worker of 2 slots. v0 admits 3 (two at 0, one at 10).
    Each update admits one group of the next version, which waits for the worker's older groups
    to drain: v1's starts at 20, v2's at 30, ... Steady state: one group every 10 s, so 10 s an
    update, each consumed two versions after the one it was generated with."""
    sched = simulate_throughput(
        8, ThroughputCosts(group_s=10, train_s=1), _policy(math.inf), batch=1, slots=2, queue_cap=3
    )
    assert [(u.train_start, u.train_end) for u in sched.updates[:6]] == [
        (10, 11), (11, 12), (20, 21), (30, 31), (40, 41), (50, 51)
    ]  # fmt: skip
    assert [u.staleness for u in sched.updates[:6]] == [(0,), (1,), (2,), (2,), (2,), (2,)]
    assert sched.seconds_per_update(skip=2) == 10


def test_reload_staleness_lowers_the_budget_between_reload_points():
    """η_r = 2, η_a = 1, B = 1, one slot, loading a version 0.5 s. v0 admits 2 (w = 0, after
    the first load: [0.5, 10.5], [10.5, 20.5]); at v1 the workers still serve 0, so the budget
    is B·(1 − 1 + 1) = 1 and nothing more is admitted; at v2 (a reload point) two again, after
    the load: [22, 32], [32, 42]. Staleness alternates 0, 1."""
    sched = simulate_throughput(
        4,
        ThroughputCosts(group_s=10, train_s=1, reload_s=0.5),
        _policy(1, eta_r=2),
        batch=1,
        slots=1,
    )
    got = [(u.train_start, u.train_end, u.versions) for u in sched.updates]
    assert got == [(10.5, 11.5, (0,)), (20.5, 21.5, (0,)), (32, 33, (2,)), (42, 43, (2,))]
    assert sched.staleness_counts() == {0: 2, 1: 2}


def test_a_reload_waits_for_the_workers_groups_and_holds_all_its_slots():
    """η_a = 1, B = 1, one worker of 2 slots, loads of 2 s. v0's two groups start after the
    first load, at 2 (in at 12): updates 0 and 1 at 12 and 13. v1's group (admitted at 13)
    waits for the load, 15..25; v2's (admitted at 14) for v1's group to finish and its load,
    27..37. One update per group and load: 12 s."""
    sched = simulate_throughput(
        5,
        ThroughputCosts(group_s=10, train_s=1, reload_s=2),
        _policy(1),
        batch=1,
        slots=2,
    )
    assert [u.train_start for u in sched.updates] == [12, 13, 25, 37, 49]
    assert [u.staleness for u in sched.updates] == [(0,), (1,), (1,), (1,), (1,)]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="must be >= 1"):
        simulate_throughput(1, COSTS, _policy(1), batch=0, slots=1)
    with pytest.raises(ValueError, match="finite number"):
        ThroughputCosts(group_s=-1, train_s=1)


def test_freshest_first_takes_a_group_on_its_last_acceptable_update_before_it_ages_out():
    """η_a = 2, B = 1, 4 slots, groups of 1 s, updates of 10 s. v0 admits 3 (in at 1; the wait
    buffers all three): updates 0-2 take them at 1, 11, 21, admitting one more group of the
    current version at 11 (v1, in at 12), 21 (v2, in at 22), 31 (v3, in at 32), 41 (v4).
    At v3 the wait at 31 buffers v1 and v2. v1 is on its last acceptable update (at v4 it would
    be 3 > η_a old), so freshest first takes it before v2, as oldest first does (before
    StalenessPolicy.consumption it took v2 and then discarded v1)."""
    costs = ThroughputCosts(group_s=1, train_s=10)
    oldest = simulate_throughput(5, costs, _policy(2), batch=1, slots=4)
    freshest = simulate_throughput(5, costs, _policy(2), batch=1, slots=4, freshest_first=True)
    for sched in (oldest, freshest):
        assert [u.train_start for u in sched.updates] == [1, 11, 21, 31, 41]
        assert [u.versions for u in sched.updates] == [(0,), (0,), (0,), (1,), (2,)]
        assert sched.discarded == 0


def test_freshest_first_takes_an_old_group_early_when_later_updates_could_not_take_all():
    """η_a = 3, B = 1, 4 slots, updates of 10 s, groups whose generation ends after 1, 3, 1,
    3, ... s. v0 admits 4 (in at 1, 3, 1, 3): updates 0 and 1 take the two in at 1 (at 1 and
    11); each round admits one group of its version (v1 in at 12, v2 at 24, v3 at 32). At v2
    two v0 groups wait beside v1. Both are acceptable through v3, but updates 2 and 3 take one
    group each, so one v0 goes now, though v1 is fresher, and the other at v3 (before
    StalenessPolicy.consumption freshest first took v1, then one v0, and discarded the other)."""
    draws = itertools.cycle([1.0, 3.0])
    sched = simulate_throughput(
        6,
        ThroughputCosts(group_s=1, train_s=10),
        _policy(3),
        batch=1,
        slots=4,
        freshest_first=True,
        lengths=lambda: (1.0, next(draws)),
    )
    assert [u.versions for u in sched.updates] == [(0,), (0,), (0,), (0,), (1,), (2,)]
    assert sched.discarded == 0


def test_a_verifier_of_few_slots_queues_the_groups_samples():
    """η_a = 0, B = 2 groups of 3 samples, 2 slots on one worker: both generated at 10. The
    verifier's 2 sandboxes take the 6 samples (1 s each) in order: group 0's on both slots
    [10, 11] and one [11, 12]; group 1's on the free slot [11, 12] and both [12, 13]. The batch
    is in at 13, trained [13, 17]; the next one 4 + 13 later. Unbounded, each group is in at 11."""
    costs = ThroughputCosts(group_s=10, check_s=1, train_s=4, samples=3)
    queued = simulate_throughput(3, costs, _policy(0), batch=2, slots=2, verifier_slots=2)
    assert [(u.train_start, u.train_end) for u in queued.updates] == [(13, 17), (30, 34), (47, 51)]
    free = simulate_throughput(3, costs, _policy(0), batch=2, slots=2)
    assert [u.train_end for u in free.updates] == [15, 30, 45]


def test_the_verifier_binds_when_its_samples_outlast_generation():
    """η_a = 1, B = 1 group of 4 samples on 1 sandbox (4 s a group) and generation of 1 s on a
    worker of 2 slots: the verifier finishes a group every 4 s and the updates (1 s) follow it,
    one every 4 s in the steady state; groups queue for it and every one is trained one version
    stale."""
    costs = ThroughputCosts(group_s=1, check_s=1, train_s=1, samples=4)
    sched = simulate_throughput(12, costs, _policy(1), batch=1, slots=2, verifier_slots=1)
    assert sched.seconds_per_update(skip=4) == pytest.approx(4)
    assert set(sched.staleness_counts(skip=4)) == {1}


def test_a_batch_waits_for_its_longest_group():
    """η_a = 0, B = 2 on 2 slots, groups of 10 s at the mean: the draws alternate a group of
    latency 1.5 (its longest sample half again the mean) and one of 0.5. Each batch ends 15 s
    after it starts, then trains 4 s: an update every 19 s, not 14."""
    draws = iter([(1.0, 1.5), (1.0, 0.5)] * 10)
    costs = ThroughputCosts(group_s=10, train_s=4)
    sched = simulate_throughput(3, costs, _policy(0), batch=2, slots=2, lengths=lambda: next(draws))
    assert [u.train_end for u in sched.updates] == [19, 38, 57]


def test_an_evaluation_waits_for_the_groups_a_worker_holds_and_the_controller_goes_on():
    """η_a = 1, B = 1 on 1 slot, 10 s a group, 1 s an update, a 3 s evaluation before rounds
    0 and 2. Round 0: evaluation [0, 3], then g0 [3, 13] and g1 [13, 23] (budget 2); update 0
    [13, 14]. Round 1 admits g2 (v1) behind g1: [23, 33]; update 1 on g1 [23, 24]. Round 2: the
    evaluation of v2 waits for g2 (the worker's epoch), [33, 36]; g3 (v2) [36, 46]; update 2
    trains g2 at once, [33, 34] (a controller that waited for the evaluation: [36, 37]). Round
    3: g4 [46, 56]; update 3 on g3 [46, 47]."""
    costs = ThroughputCosts(group_s=10, train_s=1, eval_s=3)
    sched = simulate_throughput(4, costs, _policy(1), batch=1, slots=1, eval_every=2)
    assert [u.train_end for u in sched.updates] == [14, 24, 34, 47]


def test_an_evaluation_takes_its_share_of_the_slots_and_training_the_rest():
    """η_a = 0, B = 1, 10 s a group, 4 s an update, an evaluation of 3 s (on every slot)
    before rounds 0 and 2. On 1 slot the groups wait for it (round 0 admits at 3, trained to
    17; round 2's g2 starts at 34, trained to 48). On 2 slots with eval_share 0.5 it takes one
    slot for 6 s and training starts at once on the other: updates end at 14, 28, 42, 56."""
    costs = ThroughputCosts(group_s=10, train_s=4, eval_s=3)
    one = simulate_throughput(4, costs, _policy(0), batch=1, slots=1, eval_every=2)
    assert [u.train_end for u in one.updates] == [17, 31, 48, 62]
    two = simulate_throughput(4, costs, _policy(0), batch=1, slots=2, eval_every=2, eval_share=0.5)
    assert [u.train_end for u in two.updates] == [14, 28, 42, 56]
    with pytest.raises(ValueError, match="eval_share"):
        simulate_throughput(2, costs, _policy(0), batch=1, slots=1, eval_share=0.0)


def test_an_evaluations_checks_take_the_sandboxes_before_a_group_generated_after_it():
    """One sandbox (1 s a sample), 2 slots, eval_share 0.5: the evaluation (3 s on every slot)
    takes one slot for 6 s, g0 the other [0, 10]; the evaluation's checks (5 s) take the
    sandbox at 6, to 11, so g0 is verified [11, 12] and trained [12, 16] (15 without them)."""
    costs = ThroughputCosts(group_s=10, train_s=4, check_s=1, eval_s=3, eval_verify_s=5)
    sched = simulate_throughput(
        1, costs, _policy(0), batch=1, slots=2, verifier_slots=1, eval_every=2, eval_share=0.5
    )
    assert [u.train_end for u in sched.updates] == [16]


def test_a_round_with_everything_arrived_takes_what_is_buffered():
    """η_r = 2, η_a = 1, B = 1, 2 workers of 1 slot, an evaluation of 5 s before even rounds.
    Round 0: the evaluation [0, 5] on both, then 2 groups of v0 [5, 15]; update 0 takes one
    [15, 16], the other stays buffered. Round 1 serves v0 still (η_r = 2): its budget of 1 is
    full with the buffered group and nothing is in flight, which is acceptable (staleness 1):
    update 1 [16, 17] trains it. Round 2: the evaluation of v2 [17, 22] (the workers load v2
    for it), then two of v2 [22, 32]."""
    costs = ThroughputCosts(group_s=10, train_s=1, eval_s=5)
    sched = simulate_throughput(
        3, costs, _policy(1, eta_r=2), batch=1, slots=1, workers=2, eval_every=2,
        freshest_first=True,
    )  # fmt: skip
    assert [(u.train_end, u.versions) for u in sched.updates] == [
        (16, (0,)),
        (17, (0,)),
        (33, (2,)),
    ]


def test_episodes_wait_on_replies_without_holding_their_slots():
    """η_a = 0, B = 2, 2 slots, env_s = 3: a batch's groups end their turns at 10 and their
    replies at 13 (checked by 14, trained [14, 18]); the next batch, admitted at 18, starts at
    once: 18 s an update, the replies on its critical path."""
    costs = ThroughputCosts(group_s=10.0, check_s=1.0, train_s=4.0, env_s=3.0)
    sched = simulate_throughput(3, costs, _policy(0), batch=2, slots=2)
    assert [(u.train_start, u.train_end) for u in sched.updates] == [(14, 18), (32, 36), (50, 54)]


def test_with_overlap_a_reload_does_not_wait_for_the_workers_groups():
    """The schedule of test_one_step_of_staleness_overlaps_a_batch_with_each_update with
    ``overlap`` (inference.overlap_reload): v2's groups, admitted at 19, start at once beside
    v1's (ending at 25) and arrive at 30, so update 3 runs at [30, 34] without a wait; v3's
    (admitted at 30) and v4's (at 34) likewise: two updates every 15 s instead of every 20."""
    sched = simulate_throughput(8, COSTS, _policy(1), batch=2, slots=4, overlap=True)
    assert [u.train_end for u in sched.updates] == [15, 19, 30, 34, 45, 49, 60, 64]
    assert [u.wait_s for u in sched.updates[2:]] == [7, 0, 7, 0, 7, 0]
    assert sched.staleness_counts() == {0: 2, 1: 14}


def test_with_overlap_a_third_version_waits_for_the_oldest_to_end():
    """B = 1, η_a = 3, 4 slots, 10 s groups, 1 s updates. Four v0 groups arrive at 11 (updates
    0-3 at [11, 15]); one group each of v1 (admitted at 12, ends 22), v2 (13, ends 23) and v3
    (14). v3's load waits for v1's group to end at 22 (the worker keeps one older version), so
    it arrives at 33: updates at [23, 24], [24, 25], [33, 34]. Drained, each waits for the one
    before: [23, 24], [33, 34], [43, 44]."""
    costs = ThroughputCosts(group_s=10.0, check_s=1.0, train_s=1.0)
    for overlap, want in ((True, [24, 25, 34]), (False, [24, 34, 44])):
        sched = simulate_throughput(7, costs, _policy(3), batch=1, slots=4, overlap=overlap)
        assert [u.train_end for u in sched.updates] == [12, 13, 14, 15, *want]
        assert [u.versions for u in sched.updates[4:]] == [(1,), (2,), (3,)]
