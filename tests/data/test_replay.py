from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from rlax_tpu.data.replay import ReplayBuffer, ReplayItem


def buffer(**kw) -> ReplayBuffer:
    args = dict(
        per_prompt=4,
        max_items=100,
        recency_prob=0.5,
        recent_versions=2,
        priority="reward",
        temperature=1.0,
        seed=0,
    )
    args.update(kw)
    return ReplayBuffer(**args)


def item(pid: str, tokens, version: int = 0, reward: float = 0.0, payload=None) -> ReplayItem:
    return ReplayItem(
        prompt_id=pid, tokens=tuple(tokens), version=version, reward=reward, payload=payload
    )


def test_dedup_by_tokens_within_a_prompt():
    b = buffer()
    assert b.add(item("p", [1, 2]))
    assert not b.add(item("p", [1, 2], version=3, reward=1.0))
    assert b.add(item("q", [1, 2]))  # other prompt: not a duplicate
    assert len(b) == 2 and b.duplicates == 1


def test_per_prompt_cap_evicts_the_oldest():
    b = buffer(per_prompt=3)
    for i in range(5):
        b.add(item("p", [i], version=i))
    assert [it.tokens for it in b.items()] == [(2,), (3,), (4,)]
    assert b.evicted == 2


def test_global_cap_bounds_memory_and_evicts_oldest_overall():
    b = buffer(per_prompt=10, max_items=5)
    for i in range(8):
        b.add(item(f"p{i % 3}", [i], version=i))
    assert len(b) == 5
    assert sorted(it.tokens[0] for it in b.items()) == [3, 4, 5, 6, 7]


def test_sampling_frequencies_match_configuration():
    """Recency share ≈ m; reward-prioritized draws ≈ softmax(reward / T) (stated tolerances)."""
    m, temperature = 0.3, 0.5
    b = buffer(per_prompt=100, recency_prob=m, recent_versions=1, temperature=temperature)
    rewards = [0.0, 0.5, 1.0, 1.5]
    for v, r in enumerate(rewards):  # versions 0..3; only version 3 is "recent" at version 3
        b.add(item("p", [v], version=v, reward=r))
    n = 40_000
    draws = b.sample(n, current_version=3)
    pools = Counter(pool for _, pool in draws)
    # P(recent) = m: binomial std sqrt(m(1-m)/n) ≈ 0.0023; tolerance 5 std.
    assert abs(pools["recent"] / n - m) < 0.012
    assert {it.version for it, pool in draws if pool == "recent"} == {3}
    prioritized = [it.reward for it, pool in draws if pool == "reward"]
    expected = np.exp(np.array(rewards) / temperature)
    expected /= expected.sum()
    observed = np.array([prioritized.count(r) for r in rewards]) / len(prioritized)
    # each share has std <= sqrt(0.25/28000) ≈ 0.003; tolerance 0.015 (5 std).
    np.testing.assert_allclose(observed, expected, atol=0.015)


def test_uniform_priority_and_staleness_bound():
    b = buffer(per_prompt=100, recency_prob=0.0, priority="uniform")
    for v in range(10):
        b.add(item("p", [v], version=v, reward=float(v)))
    draws = b.sample(20_000, current_version=10, max_staleness=4)
    versions = Counter(it.version for it, _ in draws)
    assert set(versions) == {6, 7, 8, 9}  # staleness 10 - v <= 4
    for v in versions:
        assert abs(versions[v] / 20_000 - 0.25) < 0.016  # std ≈ 0.003
    assert b.sample(5, current_version=100, max_staleness=2) == []


def test_empty_recent_pool_falls_back():
    b = buffer(recency_prob=1.0, recent_versions=1)
    b.add(item("p", [1], version=0))
    draws = b.sample(10, current_version=5)
    assert [pool for _, pool in draws] == ["reward"] * 10


def test_save_restore_continues_identically():
    b = buffer(per_prompt=3, max_items=7)
    for i in range(12):
        b.add(item(f"p{i % 4}", [i, i + 1], version=i, reward=i / 3, payload={"i": i}))
    b.sample(17, current_version=12)
    state = b.state()
    fresh = buffer(per_prompt=3, max_items=7)
    fresh.restore(state)
    assert fresh.items() == b.items() and fresh.evicted == b.evicted
    assert fresh.sample(50, current_version=12) == b.sample(50, current_version=12)
    fresh.add(item("p9", [99], version=13))
    b.add(item("p9", [99], version=13))
    assert fresh.items() == b.items()


def test_bad_inputs():
    with pytest.raises(ValueError, match="non-finite reward"):
        buffer().add(item("p", [1], reward=math.nan))
    with pytest.raises(ValueError, match="recency_prob"):
        buffer(recency_prob=1.5)
    with pytest.raises(ValueError, match="must be > 0"):
        buffer(per_prompt=0)


def test_a_duplicate_replaces_the_older_copy():
    b = buffer()
    b.add(item("p", [1, 2], version=0, reward=0.0))
    b.add(item("p", [3], version=1))
    assert not b.add(item("p", [1, 2], version=5, reward=1.0))
    assert [(it.tokens, it.version) for it in b.items()] == [((3,), 1), ((1, 2), 5)]


def test_sample_groups_draws_k_items_of_one_prompt_without_replacement_when_it_can():
    b = buffer(per_prompt=8, recency_prob=0.0, priority="uniform")
    for p in "abc":
        for i in range(5):
            b.add(item(p, [i], version=0, payload=p))
    b.add(item("d", [0], version=0, payload="d"))  # one item: drawn with replacement
    for prompt, items, pool in b.sample_groups(40, 3, current_version=0):
        assert pool == "uniform" and len(items) == 3
        assert {it.prompt_id for it in items} == {prompt}
        if prompt != "d":
            assert len({it.tokens for it in items}) == 3
    assert {p for p, _, _ in b.sample_groups(200, 1, current_version=0)} == set("abcd")


def test_sample_groups_recency_pool_and_staleness_bound():
    b = buffer(per_prompt=8, recency_prob=1.0, recent_versions=2)
    for v in range(6):
        b.add(item("old" if v < 3 else "new", [v], version=v))
    groups = b.sample_groups(50, 2, current_version=5)
    assert all(pool == "recent" for _, _, pool in groups)
    assert all(it.version >= 4 for _, items, _ in groups for it in items)  # 5 - v < 2
    # Nothing recent: the other pool, and never past max_staleness.
    groups = b.sample_groups(50, 1, current_version=9, max_staleness=5)
    assert groups and all(it.version >= 4 for _, items, _ in groups for it in items)
    assert all(pool == "reward" for _, _, pool in groups)
    assert b.sample_groups(5, 1, current_version=20, max_staleness=5) == []


def test_sample_groups_prioritizes_reward_by_softmax():
    b = buffer(per_prompt=8, recency_prob=0.0, temperature=0.5)
    for i, r in enumerate([0.0, 0.0, 0.0, 1.0]):
        b.add(item("p", [i], reward=r))
    n = 4000
    hits = sum(
        it.reward == 1.0 for _, items, _ in b.sample_groups(n, 1, current_version=0) for it in items
    )
    p = math.exp(2) / (math.exp(2) + 3)  # softmax(r / 0.5)
    assert abs(hits - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_a_restored_buffer_draws_the_same_groups():
    b = buffer(per_prompt=2, max_items=3, recency_prob=0.5)
    # Evictions leave the live buffer's prompts in the order a, b, z and a restored one's in
    # b, a, z (by oldest surviving item): draws must not depend on it.
    for i, p in enumerate("zabaz"):
        b.add(item(p, [i], version=i // 2, reward=float(i % 2)))
    assert list(b._items) == ["a", "b", "z"]
    c = buffer(per_prompt=2, max_items=3, recency_prob=0.5, seed=99)
    c.restore(b.state())
    assert list(c._items) == ["b", "a", "z"]
    a1 = b.sample_groups(30, 2, current_version=4)
    a2 = c.sample_groups(30, 2, current_version=4)
    assert [(p, [it.tokens for it in its], pool) for p, its, pool in a1] == [
        (p, [it.tokens for it in its], pool) for p, its, pool in a2
    ]
