"""The engine against the trainer's replay (bitwise where the engine promises it), independent
references (the dense-cache replay and the uncached full-sequence forward, to f32 round-off),
itself alone vs in a full batch and with a starved page budget, and its start-up row check."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu import models
from rlax_tpu.inference.engine import Engine, InvalidRequest
from rlax_tpu.inference.replay import replay_logits, temperature_scaled_logprobs
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.models.paged_cache import page_bytes
from rlax_tpu.models.programs import TRACES
from rlax_tpu.types import FinishReason

from .conftest import SMALL, assert_same_samples, by_key, make_engine, random_requests


def assert_greedy(tokens: np.ndarray, logits: np.ndarray, *, tol: float) -> None:
    """tokens [T] are greedy picks from logits [T, V] computed by another program (equal to
    within ``tol``)."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol
    np.testing.assert_array_equal(tokens[clear], logits.argmax(-1)[clear])
    picked = np.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    assert (picked >= top2[:, 1] - 2 * tol).all()


def assert_the_replay(
    model: models.Transformer, engine: Engine, rollouts: list, *, temperature: float
) -> np.ndarray:
    """The rollouts' log-probs are the trainer's replay of them (bitwise where the engine's
    start-up check found rows independent, else to 1e-5); returns the replay [N, T]."""
    tokens = np.zeros((len(rollouts), 48), np.int32)
    for i, ro in enumerate(rollouts):
        seq = [*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]
        tokens[i, : len(seq)] = seq
    prompt = np.array([len(ro.prompt_tokens) for ro in rollouts])
    completion = np.array([len(ro.tokens) for ro in rollouts])
    replay = models.replay_logprobs(
        model, tokens, prompt, completion, shape=engine.replay_shape, temperature=temperature
    )
    for i, ro in enumerate(rollouts):
        if engine.rows_bitwise:
            np.testing.assert_array_equal(ro.logprobs, replay[i, : len(ro.tokens)])
        else:  # this host rounds rows by their index: the tolerance mode (engine.py)
            np.testing.assert_allclose(ro.logprobs, replay[i, : len(ro.tokens)], atol=1e-5)
        assert ro.logprobs.dtype == np.float32
    return replay


def _run_checked(engine: Engine) -> list:
    """Steps to completion, checking the scheduler's invariants after every step."""
    out = []
    while engine.has_work():
        out += engine.step()
        engine.scheduler.check_invariants()
    assert all(a.num_used == 0 for a in engine.allocators)
    return out


@pytest.mark.parametrize(
    "prefill",
    [
        dict(prefill_rows=0),
        dict(prefill_rows=4, prefill_len=16),
        dict(prefill_rows=2, prefill_len=3),
    ],
    ids=["rows-only", "prefill-4x16", "prefill-2x3"],
)
def test_logprobs_are_bitwise_the_replay_and_close_to_a_dense_reference(tiny_model, prefill):
    engine = make_engine(tiny_model, **prefill)
    requests = random_requests(5, num_samples=2, temperature=0.8)
    for r in requests:
        engine.submit(r)
    rollouts = _run_checked(engine)
    assert len(rollouts) == 10
    # The trainer's replay runs the engine's own programs: bitwise wherever the engine's
    # start-up check finds rows independent (engine.py).
    # Rows in another order than the engine ran them, several rollouts per step.
    rollouts.sort(key=lambda ro: (-len(ro.tokens), ro.prompt_id, ro.sample_index))
    replay = assert_the_replay(tiny_model, engine, rollouts, temperature=0.8)
    completion = np.array([len(ro.tokens) for ro in rollouts])
    width = max(len(ro.tokens) for ro in rollouts)
    assert np.count_nonzero(replay) == completion.sum() and replay.shape[1] == width
    # Another program for the same math (dense cache, separate log-softmax) agrees to f32
    # round-off; how far depends on the host's XLA choices (observed <= 5e-7).
    for ro in rollouts[:4]:
        seq = [*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]
        logits = replay_logits(tiny_model, seq[:-1], prompt_len=len(ro.prompt_tokens))
        want = temperature_scaled_logprobs(logits, ro.tokens.tolist(), 0.8)
        np.testing.assert_allclose(ro.logprobs, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("span_groups", [0, 2], ids=["whole-cache", "span-groups"])
def test_greedy_equals_the_uncached_forward(tiny_model, span_groups):
    engine = make_engine(tiny_model, span_groups=span_groups)
    for r in random_requests(4, seed=1, temperature=0.0):
        engine.submit(r)
    forward = jax.jit(models.forward)
    for ro in _run_checked(engine):
        p, n = len(ro.prompt_tokens), len(ro.tokens)
        seq = np.zeros((1, 48), np.int32)  # right padding: causal, so earlier logits unchanged
        seq[0, : p + n] = [*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]
        logits = forward(tiny_model, jnp.asarray(seq))[0, p - 1 : p + n - 1]
        # Log-probs equal up to f32 round-off (another program: XLA rounds differently; observed
        # < 1e-6), so tokens equal the forward's argmax wherever its top two are not tied
        # within that round-off, and are a near-tied maximum where they are.
        assert_greedy(ro.tokens, np.asarray(logits), tol=1e-5)
        want = np.asarray(models.token_logprobs(logits[None], jnp.asarray(ro.tokens)[None])[0])
        np.testing.assert_allclose(ro.logprobs, want, rtol=0, atol=1e-5)
        assert ro.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    "sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)]
)
def test_a_request_samples_the_same_alone_and_in_a_full_batch(tiny_model, sampling):
    probe = dataclasses.replace(
        random_requests(1, seed=7, num_samples=3, **sampling)[0], prompt_id="probe"
    )
    alone = make_engine(tiny_model)
    alone.submit(probe)
    want = by_key(alone.run())
    crowded = make_engine(tiny_model)
    for r in random_requests(6, seed=8, **sampling)[:3]:
        crowded.submit(r)
    crowded.submit(probe)
    for r in random_requests(6, seed=9, num_samples=2, **sampling):
        crowded.submit(r)
    got = by_key(_run_checked(crowded))
    for key, ro in want.items():
        assert_same_samples(got[key], ro, bitwise=crowded.rows_bitwise)


def test_preemption_under_a_tiny_page_budget_gives_identical_outputs(tiny_model):
    requests = random_requests(10, seed=3, num_samples=2, temperature=1.0)
    roomy = make_engine(tiny_model)
    for r in requests:
        roomy.submit(r)
    want = by_key(roomy.run())
    # One max-length sequence (48 tokens = 12 pages) plus the null page and 3 spare pages.
    starved = make_engine(tiny_model, kv_cache_bytes=16 * page_bytes(tiny_model.cfg, 4))
    for r in requests:
        starved.submit(r)
    got = by_key(_run_checked(starved))
    assert starved.scheduler.num_preemptions > 0
    assert got.keys() == want.keys()  # every request finished
    for key, ro in want.items():
        assert_same_samples(got[key], ro, bitwise=starved.rows_bitwise)


def test_prefix_sharing_and_copy_on_write_do_not_change_samples(tiny_model):
    prompt = tuple(range(1, 19))  # 18 tokens: 4 full pages + a partial one (page_size 4)
    sampling = SamplingParams(max_new_tokens=6, seed=5)
    group = make_engine(tiny_model)
    group.submit(Request(prompt_id="g", prompt_tokens=prompt, num_samples=8, sampling=sampling))
    group.step()  # prefill of the shared prompt (17 positions in chunks of 8 rows)
    group.step()
    group.step()
    assert group.stats().pages_shared == 7 * 5  # 5 pages held once instead of 8 times
    got = by_key(_run_checked(group))
    assert len({tuple(r.tokens) for r in got.values()}) > 1  # samples do differ
    for i in (0, 5):
        single = make_engine(tiny_model)
        single.submit(
            Request(prompt_id="g", prompt_tokens=prompt, num_samples=i + 1, sampling=sampling)
        )
        assert_same_samples(by_key(single.run())["g", i], got["g", i], bitwise=single.rows_bitwise)


def test_stop_tokens_and_eos_end_a_sample(tiny_model):
    base = make_engine(tiny_model)
    probe = Request(
        prompt_id="s",
        prompt_tokens=(5, 6, 7),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=10),
    )
    base.submit(probe)
    tokens = base.run()[0].tokens.tolist()
    stop = tokens[3]
    first = tokens.index(stop)
    stopped = make_engine(tiny_model)
    stopped.submit(
        dataclasses.replace(
            probe, sampling=dataclasses.replace(probe.sampling, stop_token_ids=(stop,))
        )
    )
    (ro,) = stopped.run()
    assert ro.tokens.tolist() == tokens[: first + 1] and ro.finish_reason is FinishReason.EOS
    eos = make_engine(tiny_model, eos_ids=(stop,))
    eos.submit(probe)
    assert eos.run()[0].finish_reason is FinishReason.EOS
    eos.submit(
        dataclasses.replace(probe, sampling=dataclasses.replace(probe.sampling, ignore_eos=True))
    )
    assert eos.run()[0].tokens.tolist() == tokens


def _first_end(tokens: list[int], found) -> int:
    """The length of the shortest prefix of ``tokens`` for which ``found(prefix)`` holds."""
    return next(n for n in range(1, len(tokens) + 1) if found(tokens[:n]))


def test_stop_sequences_and_strings_end_a_sample_with_the_tokens_that_complete_them(tiny_model):
    """Checked against the unconstrained sample cut where a scan of it first finds the stop;
    the tokens that complete it are kept (they were sampled). A text made of the ids, delimited,
    lets a string stop mid-token."""
    probe = Request(
        prompt_id="s",
        prompt_tokens=(5, 6, 7),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=12),
    )
    base = make_engine(tiny_model)
    base.submit(probe)
    tokens = base.run()[0].tokens.tolist()

    def text(ids) -> str:
        return "".join(f"<{t}>" for t in ids)

    def stopped_by(**stops) -> tuple[list[int], FinishReason]:
        engine = make_engine(tiny_model)
        engine.detokenize = text
        engine.submit(
            dataclasses.replace(probe, sampling=dataclasses.replace(probe.sampling, **stops))
        )
        (ro,) = engine.run()
        return ro.tokens.tolist(), ro.finish_reason

    pair = tuple(tokens[4:6])
    pairs = set(zip(tokens, tokens[1:], strict=False))
    absent = next((a, b) for a in range(512) for b in range(512) if (a, b) not in pairs)
    n = _first_end(tokens, lambda p: tuple(p[-2:]) == pair)
    assert stopped_by(stop_sequences=(absent, pair)) == (tokens[:n], FinishReason.STOP)
    mid = f"{tokens[6]}><{tokens[7]}"  # from inside one token's text into the next's
    n = _first_end(tokens, lambda p: mid in text(p))
    assert stopped_by(stop=("never", mid)) == (tokens[:n], FinishReason.STOP)
    # A stop token ending the same sample first is its end-of-sequence.
    n = _first_end(tokens, lambda p: p[-1] == tokens[5])
    assert stopped_by(stop_token_ids=(tokens[5],), stop_sequences=(pair,)) == (
        tokens[:n],
        FinishReason.EOS,
    )
    assert stopped_by(stop_sequences=(absent,)) == (tokens, FinishReason.LENGTH)
    no_tokenizer = make_engine(tiny_model)
    with pytest.raises(InvalidRequest, match="stop strings \\['x'\\] need the worker's tokenizer"):
        no_tokenizer.submit(
            dataclasses.replace(probe, sampling=dataclasses.replace(probe.sampling, stop=("x",)))
        )
    for bad in ({"stop_sequences": ((),)}, {"stop_sequences": ((1 << 20,),)}, {"stop": ("",)}):
        with pytest.raises(InvalidRequest, match="stop"):
            no_tokenizer.submit(
                dataclasses.replace(probe, sampling=dataclasses.replace(probe.sampling, **bad))
            )


def test_span_groups_sample_the_same_tokens_alone_and_in_a_full_batch(tiny_model):
    """With span groups a token's rounding depends on its group (the other rows' lengths), so
    log-probs agree to f32 round-off (observed <= 3e-7 on log-probs of O(1..10); asserted 2e-6)
    rather than bitwise; the tokens come from the same per-request streams."""
    probe = dataclasses.replace(
        random_requests(1, seed=7, num_samples=3, temperature=1.0)[0], prompt_id="probe"
    )
    alone = make_engine(tiny_model, span_groups=2)
    alone.submit(probe)
    want = by_key(alone.run())
    crowded = make_engine(tiny_model, span_groups=2)
    for r in random_requests(6, seed=8, temperature=1.0)[:3]:
        crowded.submit(r)
    crowded.submit(probe)
    for r in random_requests(6, seed=9, num_samples=2, temperature=1.0):
        crowded.submit(r)
    got = by_key(_run_checked(crowded))
    for key, ro in want.items():
        np.testing.assert_array_equal(got[key].tokens, ro.tokens)
        np.testing.assert_allclose(got[key].logprobs, ro.logprobs, rtol=0, atol=2e-6)


def test_precompile_covers_every_span_grouping(tiny_model):
    engine = make_engine(tiny_model, span_groups=2)
    choices = engine.span_choices()
    # 8 rows in two groups of 4; 12 pages in buckets of 4: spans {4, 8, 12}, non-decreasing.
    assert len(choices) == 6 and ((4, 4), (4, 12)) in choices and ((4, 12), (4, 4)) not in choices
    engine.precompile()
    steps = TRACES["step"]
    for r in random_requests(8, seed=21):
        engine.submit(r)
    _run_checked(engine)
    assert TRACES["step"] == steps
    assert make_engine(tiny_model).span_choices() == [()]


def test_steady_state_never_recompiles(tiny_model):
    engine = make_engine(tiny_model)
    for r in random_requests(6, seed=11, num_samples=3):
        engine.submit(r)
    engine.run()
    warm = engine.compilations
    assert warm <= 1 + 4  # one step program + copy buckets
    for r in random_requests(8, seed=12, num_samples=3):
        engine.submit(r)
    engine.run()
    assert engine.compilations == warm


def test_reload_aborts_in_flight_requests_and_returns_them(tiny_model):
    engine = make_engine(tiny_model, overlap_reload=False)
    for r in random_requests(6, seed=13, num_samples=2, max_new=24):
        engine.submit(
            dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=20))
        )
    done = engine.step() + engine.step() + engine.step() + engine.step()
    new = jax.tree.map(lambda x: x * 1.5, engine.state)
    aborted = engine.load_weights(1, new)
    assert engine.version == 1 and not engine.has_work()
    assert all(a.num_used == 0 for a in engine.allocators)
    keys = {(r.prompt_id, r.sample_index) for r in done + aborted}
    assert keys == {(f"r{i}", j) for i in range(6) for j in range(2)}  # nothing disappears
    assert all(r.finish_reason is FinishReason.ABORTED for r in aborted)
    assert any(len(r.tokens) > 0 for r in aborted) and all((r.versions == 0).all() for r in aborted)
    engine.submit(random_requests(1, seed=14)[0])
    assert all((r.versions == 1).all() for r in engine.run())


def test_an_overlapped_reload_finishes_each_sample_on_the_weights_it_started_on(tiny_model):
    """A reload under running samples (``overlap_reload``) aborts none: they finish
    on version 0's weights beside version 1's requests, each sample what an engine serving its
    version alone gives (bitwise where rows are independent), and the older copy goes with its
    last sequence. Kept pages of version 0 are neither kept nor taken by version 1."""
    scaled = jax.tree.map(lambda x: x * 1.5, make_engine(tiny_model).state)
    overlap = dict(overlap_reload=True)
    old = [
        dataclasses.replace(r, keep_pages=True)
        for r in random_requests(4, seed=13, num_samples=2, max_new=24, ignore_eos=True)
    ]
    new = [
        dataclasses.replace(r, prompt_id=f"n{i}")
        for i, r in enumerate(random_requests(3, seed=14, num_samples=2))
    ]
    alone = {}
    for version, reqs, state in ((0, old, None), (1, new, scaled)):
        ref = make_engine(tiny_model, **overlap)
        if state is not None:
            ref.load_weights(version, state)
        for r in reqs:
            ref.submit(dataclasses.replace(r, keep_pages=False))
        alone |= by_key(_run_checked(ref))

    engine = make_engine(tiny_model, **overlap)
    for r in old:
        engine.submit(r)
    done = engine.step() + engine.step() + engine.step()
    assert engine.load_weights(1, scaled) == []
    assert engine.version == 1 and engine.older_version == 0 and engine.holds(0)
    for r in new:
        engine.submit(r)
    mixed = 0
    while engine.has_work():
        weights = {s.weights for s in engine.scheduler.running}
        mixed += weights == {0, 1}
        done += engine.step()
        engine.scheduler.check_invariants()
    assert mixed > 0  # steps ran both versions' rows
    assert engine.older_version is None and not engine.holds(0)
    got = by_key(done)
    assert got.keys() == alone.keys()
    for key, ro in got.items():
        assert ro.finish_reason is not FinishReason.ABORTED
        assert (ro.versions == (0 if key[0].startswith("r") else 1)).all()
        assert_same_samples(ro, alone[key], bitwise=engine.rows_bitwise)
    assert len(engine.scheduler.kept) == 0  # version 0's pages were not kept under version 1
    assert all(a.num_used == 0 for a in engine.allocators)


def test_a_reload_while_an_older_version_still_runs_aborts_only_that_ones_samples(tiny_model):
    engine = make_engine(tiny_model, overlap_reload=True)
    slow = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine.submit(Request(prompt_id="v0", prompt_tokens=(1, 2, 3), num_samples=2, sampling=slow))
    engine.step()
    engine.load_weights(1, engine.state)
    engine.submit(Request(prompt_id="v1", prompt_tokens=(4, 5), sampling=slow))
    engine.step()
    aborted = engine.load_weights(2, engine.state)
    assert (
        sorted((r.prompt_id, r.finish_reason) for r in aborted)
        == [("v0", FinishReason.ABORTED)] * 2
    )
    assert engine.older_version == 1
    out = engine.run()
    assert [(r.prompt_id, set(r.versions.tolist())) for r in out] == [("v1", {1})]


def test_an_overlapped_reload_of_the_same_or_the_older_version_aborts_nothing(tiny_model):
    """A failover reloads the version a worker serves, and a reload may go back to the older
    one: neither aborts a sample nor lets one run on another version's weights. An engine built
    at version 3 serves its requests as version 3."""
    engine = make_engine(tiny_model, overlap_reload=True)
    slow = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine.submit(Request(prompt_id="v0", prompt_tokens=(1, 2, 3), sampling=slow))
    engine.step()
    assert engine.load_weights(1, engine.state) == []
    engine.submit(Request(prompt_id="v1", prompt_tokens=(4, 5), sampling=slow))
    engine.step()
    assert engine.load_weights(1, engine.state) == [] and engine.older_version == 0
    assert engine.load_weights(0, engine.state) == [] and engine.older_version == 1
    out = {r.prompt_id: r for r in engine.run()}
    assert {k: set(r.versions.tolist()) for k, r in out.items()} == {"v0": {0}, "v1": {1}}
    assert engine.older_version is None
    at3 = Engine(tiny_model, dataclasses.replace(SMALL, overlap_reload=True), version=3)
    at3.submit(Request(prompt_id="a", prompt_tokens=(1,)))
    assert set(at3.run()[0].versions.tolist()) == {3}


def test_continue_on_reload_records_per_token_versions(tiny_model):
    engine = make_engine(tiny_model, continue_on_reload=True)
    engine.submit(
        Request(
            prompt_id="c",
            prompt_tokens=(1, 2, 3),
            num_samples=2,
            sampling=SamplingParams(max_new_tokens=12),
        )
    )
    for _ in range(5):
        engine.step()
    assert engine.load_weights(7, engine.state) == []
    out = engine.run()
    assert len(out) == 2
    for ro in out:
        assert ro.finish_reason is FinishReason.LENGTH and len(ro.tokens) == 12
        assert ro.versions[0] == 0 and ro.versions[-1] == 7 and ro.version == 0
        assert np.all(np.diff(ro.versions) >= 0)


def test_prompt_prefixes_are_cut_at_fixed_boundaries(tiny_model):
    """Chunks [kC, (k+1)C) of the prompt but its last token, at most prefill_rows per step, none
    of a sequence's rows in a step where it has chunks; the parent forks once its prefix is in."""
    engine = make_engine(tiny_model, prefill_rows=3, prefill_len=4)
    engine.submit(Request(prompt_id="a", prompt_tokens=tuple(range(1, 12)), num_samples=2))
    engine.submit(Request(prompt_id="b", prompt_tokens=tuple(range(1, 7)), num_samples=2))
    plan = engine.scheduler.plan()
    assert [(c.seq.request.prompt_id, c.start, c.stop) for c in plan.chunks] == [
        ("a", 0, 4),
        ("a", 4, 8),
        ("a", 8, 10),
    ]  # a's prefix is 10 tokens: 3 chunks, the budget
    assert plan.rows == []
    engine.scheduler.remove_all()
    engine = make_engine(tiny_model, prefill_rows=3, prefill_len=4)
    for r in (
        Request(prompt_id="a", prompt_tokens=tuple(range(1, 12)), num_samples=2),
        Request(prompt_id="b", prompt_tokens=tuple(range(1, 7)), num_samples=2),
    ):
        engine.submit(r)
    engine.step()  # a's three chunks
    plan = engine.scheduler.plan()  # a forked: its samples feed token 10; b's 5-token prefix
    assert [(c.seq.request.prompt_id, c.start, c.stop) for c in plan.chunks] == [
        ("b", 0, 4),
        ("b", 4, 5),
    ]
    assert [(r.seq.request.prompt_id, r.seq.sample_index, r.position) for r in plan.rows] == [
        ("a", 0, 10),
        ("a", 1, 10),
    ]


def test_the_tpu_layout_serves_the_cpu_engines_tokens():
    """backend tpu_emulated: the TPU path's combined KV pages (keys and values interleaved by
    head, lane-padded; the model's 3 KV heads padded with a zero head to the 4 the kernel tiles),
    ragged packing of prefill and decode rows, copy-on-write pages and preemption, with the XLA
    stand-in for the Mosaic kernel. Greedy tokens equal the CPU engine's (tiny page budget: both
    preempt), log-probs to f32 round-off (a different summation order)."""
    model = models.init_model(models.preset("tiny", num_heads=6, num_kv_heads=3, hidden_size=192))
    requests = [
        *random_requests(12, seed=11, temperature=0.0),
        Request(
            prompt_id="group",
            prompt_tokens=tuple(range(1, 19)),
            num_samples=4,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        ),
    ]
    runs = {}
    for backend in ("cpu", "tpu_emulated"):
        budget = 16 * page_bytes(model.cfg, 4, backend)  # one max-length sequence + spares
        engine = make_engine(model, backend=backend, kv_cache_bytes=budget)
        for r in requests:
            engine.submit(r)
        runs[backend] = (by_key(_run_checked(engine)), engine)
    want, (got, tpu) = runs["cpu"][0], runs["tpu_emulated"]
    assert tpu.backend == "tpu_emulated" and tpu.cache.kv_pages is not None
    assert tpu.cache.kv_pages.shape[-2:] == (2 * 4, 128)
    assert tpu.scheduler.num_preemptions > 0 and tpu.stats().pages_shared > 0
    assert got.keys() == want.keys()
    for key, ro in want.items():
        np.testing.assert_array_equal(got[key].tokens, ro.tokens)
        np.testing.assert_allclose(got[key].logprobs, ro.logprobs, rtol=0, atol=2e-5)


def test_a_continuation_samples_what_the_uninterrupted_sequence_did(tiny_model):
    """A request that continues a sequence (an episode's next turn) feeds the tokens it holds
    like a preempted sequence's and samples after them with the same streams: the same tokens
    and log-probs as the sequence that was never interrupted, under a starved page budget too."""
    requests = random_requests(4, seed=5, num_samples=2, max_new=24, temperature=1.0)
    requests = [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=20))
        for r in requests
    ]
    whole = make_engine(tiny_model)
    for r in requests:
        whole.submit(r)
    want = by_key(whole.run())
    for budget in (None, 16 * page_bytes(tiny_model.cfg, 4)):
        engine = make_engine(tiny_model, **({"kv_cache_bytes": budget} if budget else {}))
        for r in requests:  # the first 7 tokens of each sample are the continuation
            for i in range(r.num_samples):
                held = tuple(int(t) for t in want[r.prompt_id, i].tokens[:7])
                engine.submit(
                    dataclasses.replace(
                        r,
                        prompt_id=f"{r.prompt_id}/{i}",
                        num_samples=1,
                        continuation=held,
                        sampling=dataclasses.replace(r.sampling, max_new_tokens=13),
                    )
                )
        got = _run_checked(engine)
        if budget:
            assert engine.scheduler.num_preemptions > 0
        for ro in got:
            key, i = ro.prompt_id.split("/")
            # Sample i of the whole request drew with stream i; alone, its continuation is
            # sample 0 of its own request: the draws match where the streams do (i = 0).
            if i != "0":
                continue
            full = want[key, 0]
            assert len(ro.tokens) == 13 and ro.prompt_tokens.tolist() == list(full.prompt_tokens)
            tail = dataclasses.replace(
                full, tokens=full.tokens[7:], logprobs=full.logprobs[7:], versions=full.versions[7:]
            )
            assert_same_samples(ro, tail, bitwise=engine.rows_bitwise)


def test_an_episodes_turns_are_bitwise_the_replay_of_the_whole_episode(tiny_model):
    """Turn 2 continues turn 1 after the environment's tokens: replaying prompt + turn 1 +
    reply + turn 2 through the engine's programs gives both turns' log-probs as sampled."""
    engine = make_engine(tiny_model)
    prompt = tuple(range(3, 14))
    engine.submit(Request(prompt_id="t1", prompt_tokens=prompt, sampling=SamplingParams(
        temperature=0.8, max_new_tokens=9, seed=1)))  # fmt: skip
    [turn1] = engine.run()
    reply = (500, 17, 42, 8)
    engine.submit(
        Request(
            prompt_id="t2",
            prompt_tokens=prompt,
            continuation=(*turn1.tokens.tolist(), *reply),
            sampling=SamplingParams(temperature=0.8, max_new_tokens=10, seed=2),
        )
    )
    [turn2] = engine.run()
    assert len(turn2.tokens) == 10 and turn2.prompt_tokens.tolist() == list(prompt)
    episode = [*turn1.tokens.tolist(), *reply, *turn2.tokens.tolist()]
    tokens = np.zeros((1, 48), np.int32)
    tokens[0, : len(prompt) + len(episode)] = [*prompt, *episode]
    replay = models.replay_logprobs(
        tiny_model,
        tokens,
        np.array([len(prompt)]),
        np.array([len(episode)]),
        shape=engine.replay_shape,
        temperature=0.8,
    )[0]
    got = np.concatenate([replay[: len(turn1.tokens)], replay[len(turn1.tokens) + len(reply) :]])
    want = np.concatenate([turn1.logprobs, turn2.logprobs])
    if engine.rows_bitwise:
        np.testing.assert_array_equal(got[: len(want)], want)
    else:
        np.testing.assert_allclose(got[: len(want)], want, atol=1e-5)


def test_a_continuation_that_cannot_fit_is_refused(tiny_model):
    engine = make_engine(tiny_model)
    long = Request(
        prompt_id="x",
        prompt_tokens=(1,) * 20,
        continuation=(2,) * 20,
        sampling=SamplingParams(max_new_tokens=20),
    )
    with pytest.raises(Exception, match=r"prompt 20 \+ continuation 20 \+ max_new_tokens 20"):
        engine.submit(long)
    with pytest.raises(Exception, match=r"token ids \[9999\] outside the vocabulary"):
        engine.submit(dataclasses.replace(long, continuation=(9999,)))
