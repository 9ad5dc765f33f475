"""Kept pages (``Request.keep_pages``): an episode's next turn takes its earlier turns' pages
instead of recomputing them, with the same tokens and log-probs as recomputing (bitwise where
the engine promises it), and kept pages never cost a running sequence its pages."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tpu.inference.pages import PageAllocator
from rlax_tpu.inference.prefix_cache import PrefixCache
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.models.paged_cache import page_bytes

from .conftest import assert_same_samples, make_engine


def test_the_cache_finds_the_longest_entry_a_sequence_starts_with_and_gives_it_once():
    alloc = PageAllocator(16)
    cache = PrefixCache(page_size=4)
    short, long = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]
    cache.put(alloc, 0, short, alloc.allocate(2))
    cache.put(alloc, 0, long, alloc.allocate(4))  # one page more than its 9 tokens need
    assert alloc.num_used == 2 + 3  # the spare page went back
    assert cache.find([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).tokens == tuple(long)
    assert cache.find([1, 2, 3, 4, 5, 6]).tokens == tuple(short)
    assert cache.find([1, 2, 3]) is None and cache.find([9, 2, 3, 4, 5, 6]) is None
    entry = cache.find(long + [0])
    pages = cache.take(entry, alloc, 6)  # positions 0..5: two pages, the third released
    assert len(pages) == 2 and alloc.num_used == 2 + 2 and cache.reused_tokens == 6
    assert cache.find(long + [0]).tokens == tuple(short)  # taken once: only the short one left
    alloc.check_no_leaks([pages, *cache.held(0)])


def test_eviction_drops_the_oldest_entries_of_the_short_shard_first():
    allocs = [PageAllocator(6), PageAllocator(6)]
    cache = PrefixCache(page_size=4)
    cache.put(allocs[0], 0, [1] * 8, allocs[0].allocate(2))
    cache.put(allocs[1], 1, [2] * 8, allocs[1].allocate(2))
    cache.put(allocs[0], 0, [3] * 8, allocs[0].allocate(2))
    assert allocs[0].num_free == 1
    assert cache.evict(allocs[0], 0, 3)
    assert allocs[0].num_free == 3 and cache.find([1] * 8) is None  # the oldest went
    assert cache.find([3] * 8) is not None and cache.find([2] * 8) is not None
    spare = cache.find([3] * 8)
    assert not cache.evict(allocs[0], 0, 5, spare=spare)  # nothing else on shard 0
    cache.clear(allocs)
    assert len(cache) == 0 and allocs[0].num_used == allocs[1].num_used == 0


def _turn(prompt, held, *, seed, max_new, keep=True, rid="t"):
    return Request(
        prompt_id=rid,
        prompt_tokens=prompt,
        continuation=tuple(held),
        keep_pages=keep,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed),
    )


def _episode(engine, prompt, reply, *, keep):
    """Three turns with an environment reply between them; (turns, engine stats)."""
    turns, held = [], []
    for k in range(3):
        engine.submit(_turn(prompt, held, seed=10 + k, max_new=5, keep=keep, rid=f"t{k}"))
        while engine.has_work():
            out = engine.step()
            engine.scheduler.check_invariants()
        [ro] = out
        turns.append(ro)
        held += [*ro.tokens.tolist(), *reply]
    return turns


@pytest.mark.parametrize(
    "prefill", [dict(prefill_rows=0), dict(prefill_rows=2, prefill_len=3)], ids=["rows", "prefill"]
)
def test_a_next_turn_on_kept_pages_samples_what_recomputing_does(tiny_model, prefill):
    prompt, reply = tuple(range(3, 14)), (500, 17, 42)
    fresh = make_engine(tiny_model, **prefill)
    want = _episode(fresh, prompt, reply, keep=False)
    assert fresh.stats().prefix_tokens_reused == 0
    kept = make_engine(tiny_model, **prefill)
    got = _episode(kept, prompt, reply, keep=True)
    for g, w in zip(got, want, strict=True):
        assert_same_samples(g, w, bitwise=kept.rows_bitwise)
    # Turn k + 1 takes everything turn k computed: the prompt and its turns but the last token.
    computed = [len(prompt) + sum(len(t.tokens) + len(reply) for t in got[:k]) + len(got[k].tokens) - 1
                for k in range(2)]  # fmt: skip
    assert kept.stats().prefix_tokens_reused == sum(computed)
    # Only the last turn's pages are still kept; new weights drop them.
    assert len(kept.scheduler.kept) == 1 and kept.stats().pages_free < kept.stats().pages_total
    kept.load_weights(1, kept.state)
    assert len(kept.scheduler.kept) == 0 and kept.stats().pages_free == kept.stats().pages_total


def test_kept_pages_are_evicted_before_a_running_sequence_is_preempted(tiny_model):
    """A budget of 16 pages: 6 finished first turns keep theirs, then 6 continuations and a
    group of 4 that needs most of the pool run; kept pages go first (a continuation whose
    pages went recomputes them), and every output is what a fresh engine gives."""
    budget = 16 * page_bytes(tiny_model.cfg, 4)
    prompts = [
        tuple(int(t) for t in np.random.default_rng(i).integers(0, 512, 9)) for i in range(6)
    ]
    group = Request(
        prompt_id="group",
        prompt_tokens=tuple(range(1, 19)),
        num_samples=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=7),
    )

    def play(engine, keep):
        for i, p in enumerate(prompts):
            engine.submit(_turn(p, (), seed=i, max_new=6, keep=keep, rid=f"a{i}"))
        first = {ro.prompt_id: ro for ro in engine.run()}
        for i, p in enumerate(prompts):
            held = [*first[f"a{i}"].tokens.tolist(), 7, 8]
            engine.submit(_turn(p, held, seed=50 + i, max_new=6, keep=False, rid=f"b{i}"))
        engine.submit(group)
        out = []
        while engine.has_work():
            out += engine.step()
            engine.scheduler.check_invariants()
        return {(ro.prompt_id, ro.sample_index): ro for ro in out}

    fresh = make_engine(tiny_model)  # the default budget: nothing evicted or preempted
    want = play(fresh, keep=False)
    starved = make_engine(tiny_model, kv_cache_bytes=budget)
    preempt, kept_at_preemption = starved.scheduler._preempt, []

    def watched(seq):
        kept_at_preemption.append(len(starved.scheduler.kept.held(seq.shard)))
        preempt(seq)

    starved.scheduler._preempt = watched
    got = play(starved, keep=True)
    assert kept_at_preemption and not any(kept_at_preemption)  # preempted: nothing kept left
    assert got.keys() == want.keys()
    for key in want:
        assert_same_samples(got[key], want[key], bitwise=starved.rows_bitwise)
    reused = starved.stats().prefix_tokens_reused
    assert 0 < reused < sum(len(p) + 5 for p in prompts)  # some taken, some evicted (42 here)
    assert len(starved.scheduler.kept) == 0
    assert all(a.num_used == 0 for a in starved.allocators)
