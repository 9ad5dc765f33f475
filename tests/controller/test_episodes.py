"""An episode is the model's turns exactly as sampled with the environment's replies between
them: the ids the trainer gets are the ids the engine produced, the replies are out of the loss,
and a turn generated from other tokens than the episode's is refused."""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import EnvironmentConfig, InferenceConfig
from rlax_tpu.config.smollm2 import smollm2_gguf
from rlax_tpu.controller.episodes import EpisodeRunner, episode_rollout
from rlax_tpu.controller.pool import WorkerPool
from rlax_tpu.environments import Reply
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.worker import DictWeightSource, InferenceWorker
from rlax_tpu.models.tokenizer import Tokenizer
from rlax_tpu.types import FinishReason, Rollout, TrainBatch, VerdictKind


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(str(smollm2_gguf()))


def _turn(prompt, tokens, version, seed):
    rng = np.random.default_rng(seed)
    return Rollout(
        prompt_id="k",
        sample_index=0,
        prompt_tokens=np.asarray(prompt, np.int32),
        tokens=np.asarray(tokens, np.int32),
        logprobs=-rng.uniform(0.1, 3.0, len(tokens)).astype(np.float32),
        versions=np.full(len(tokens), version, np.int64),
        finish_reason=FinishReason.EOS,
    )


def test_an_episode_keeps_the_sampled_ids_and_masks_the_replies(tok):
    im_end = tok.backend.token_to_id("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write f."}]))
    # "return" drawn letter by letter: not the ids re-encoding its text gives.
    first = tok.encode("```python\ndef f():\n    ") + [tok.encode(c)[0] for c in "return"]
    first += tok.encode(" 1\n```") + [im_end]
    reply = tok.turn_ids("Your program failed: wrong answer.", after=first)
    turn0 = _turn(prompt, first, 3, 0)
    turn1 = _turn(prompt, tok.encode("```python\nx\n```") + [im_end], 3, 1)  # a continuation
    ep = episode_rollout([turn0, turn1], [reply], prompt_id="k", sample_index=5)

    assert (ep.prompt_id, ep.sample_index, ep.version) == ("k", 5, 3)
    np.testing.assert_array_equal(ep.prompt_tokens, prompt)
    np.testing.assert_array_equal(ep.tokens, [*first, *reply, *turn1.tokens])
    np.testing.assert_array_equal(
        ep.logprobs, [*turn0.logprobs, *np.zeros(len(reply)), *turn1.logprobs]
    )
    assert ep.sampled.tolist() == [True] * len(first) + [False] * len(reply) + [True] * len(
        turn1.tokens
    )
    # A detokenize/retokenize round trip would have handed the trainer other ids.
    text = tok.decode([*prompt, *ep.tokens], skip_special_tokens=False)
    assert tok.encode(text) != [*prompt, *ep.tokens]

    batch = TrainBatch.from_rollouts([ep, turn0], np.zeros(2), group_size=2)
    np.testing.assert_array_equal(batch.completion_mask()[0, : len(ep.tokens)], ep.sampled)
    assert batch.completion_mask()[1].sum() == len(first)


def test_a_turn_from_another_prompt_is_refused(tok):
    turn0 = _turn([1, 2], [3, 4], 0, 0)
    stray = _turn([1, 9], [5], 0, 1)
    with pytest.raises(ValueError, match="turn 1 of episode k/0 was generated from another"):
        episode_rollout([turn0, stray], [[8, 8]], prompt_id="k", sample_index=0)
    with pytest.raises(ValueError, match="2 turns has 1 replies between them, got 0"):
        episode_rollout([turn0, stray], [], prompt_id="k", sample_index=0)
    ok = dataclasses.replace(stray, prompt_tokens=np.array([1, 2], np.int32))
    ep = episode_rollout([turn0, ok], [[8, 8]], prompt_id="k", sample_index=0)
    assert ep.versions.tolist() == [0, 0, 0, 0, 0]


def test_an_episode_carries_its_last_turns_routes_into_the_batch():
    # A MoE worker's routes cover the whole sequence a turn computed: the last turn's is the
    # episode's (prompt, earlier turns, replies, its own tokens).
    turn0 = _turn([1, 2], [3, 4], 0, 0)
    whole = np.arange(2 + 2 + 2 + 3 * 1, dtype=np.int16)[:, None, None].repeat(2, 1)  # [S, 2, 1]
    turn1 = dataclasses.replace(_turn([1, 2], [5, 6, 7], 0, 1), routes=whole[: 2 + 2 + 2 + 3])
    ep = episode_rollout([turn0, turn1], [[8, 8]], prompt_id="k", sample_index=0)
    np.testing.assert_array_equal(ep.routes, turn1.routes)
    batch = TrainBatch.from_rollouts([ep, turn0], np.zeros(2), group_size=2)
    np.testing.assert_array_equal(batch.routes[0, :9], whole[:9])
    assert (batch.routes[1] == -1).all()  # a rollout without routes: the router's own
    short = dataclasses.replace(_turn([1, 2], [5, 6], 0, 1), routes=whole[:7])
    with pytest.raises(ValueError, match="routes cover 7 positions, the episode has 9"):
        episode_rollout([turn0, short], [[8, 8, 8]], prompt_id="k", sample_index=0)


# -- scheduling: episodes over real workers (the tiny model), one by one or in lock-step --------

SCHED_CFG = InferenceConfig(
    max_concurrent_seqs=8,
    page_size=4,
    kv_cache_bytes=2**20,
    prefill_chunk=8,
    max_prompt_len=16,
    max_new_tokens=40,
)


class ByteIds:
    """A stand-in for the chat tokenizer over the tiny model's 512 ids (the subject here is when
    turns run, not how replies are tokenized): a reply's bytes are its ids."""

    def decode(self, ids):
        return " ".join(map(str, ids))

    def turn_ids(self, text, *, after=()):
        return list(text.encode())


class Again:
    """Asks for another turn after every turn (reward: the turns so far); ``gate``: the first
    reply of the group ``waits`` waits until group ``until`` asks for its second reply."""

    def __init__(self, waits: str = "", until: str = ""):
        self.waits, self.until = waits, until
        self.reached = threading.Event()
        self.waited: bool | None = None  # whether the gate opened (None: never asked)

    def reply(self, problem, answers, tools):
        if problem == self.until and len(answers) == 2:
            self.reached.set()
        if problem == self.waits and len(answers) == 1:
            self.waited = self.reached.wait(timeout=120)
        return Reply(text=f"again {len(answers)}", reward=float(len(answers)))


@pytest.fixture(scope="module")
def tiny_weights():
    model = models.init_model(models.preset("tiny"))
    return model, DictWeightSource({0: nnx.to_pure_dict(nnx.split(model)[1])})


def _runner(env, pool, *, per_episode: bool, max_turns: int = 3) -> EpisodeRunner:
    cfg = EnvironmentConfig(name="code_repair", max_turns=max_turns, turn_tokens=6)
    return EpisodeRunner(
        env, None, ByteIds(), cfg, pool=pool, seed=3, max_new_tokens=40, stop_token_ids=(),
        per_episode=per_episode,
    )  # fmt: skip


def _groups(n: int, samples: int = 2) -> tuple[list[Request], dict[str, str]]:
    rng = np.random.default_rng(5)
    reqs = [
        Request(
            prompt_id=f"g{i}",
            prompt_tokens=tuple(int(t) for t in rng.integers(0, 256, 6)),
            num_samples=samples,
            sampling=SamplingParams(seed=40 + i, max_new_tokens=6),
        )
        for i in range(n)
    ]
    return reqs, {r.prompt_id: r.prompt_id for r in reqs}


def test_an_episode_takes_its_next_turn_without_waiting_for_the_others(tiny_weights):
    """One by one: group g1's episodes play their second turn while g0's first reply is still
    being computed (in lock-step that reply would hold every second turn back)."""
    model, source = tiny_weights
    workers = [InferenceWorker(model, SCHED_CFG, weight_source=source) for _ in range(2)]
    pool = WorkerPool(workers, exclusive_jobs=True)
    env = Again(waits="g0", until="g1")
    runner = _runner(env, pool, per_episode=True)
    try:
        reqs, problems = _groups(2, samples=1)
        played = runner.play(0, reqs, problems)
        assert env.waited is True
        assert [len(ep.tokens) > len(first.tokens) for ep, first in
                zip(played.episodes, played.first_turns, strict=True)] == [True, True]  # fmt: skip
        assert played.rewards == [3.0, 3.0]  # "last": the third turn's reward
    finally:
        runner.close()
        pool.close()
        for w in workers:
            w.shutdown()


def test_one_by_one_plays_the_same_episodes_as_lock_step(tiny_weights):
    """The schedule decides when turns run, never what they sample: the same episodes (bit for
    bit where the engine's rows are, as deterministic mode requires to play one by one), each
    later turn continuing its episode's kept pages on the worker of its first turn."""
    model, source = tiny_weights
    got = {}
    for per_episode in (False, True):
        workers = [InferenceWorker(model, SCHED_CFG, weight_source=source) for _ in range(2)]
        pool = WorkerPool(workers, exclusive_jobs=True)
        runner = _runner(Again(), pool, per_episode=per_episode)
        try:
            reqs, problems = _groups(3)
            got[per_episode] = runner.play(0, reqs, problems)
            status = [w.status() for w in workers]
            assert sum(s.prefix_tokens_reused for s in status) > 0
            bitwise = all(s.rows_bitwise for s in status)
        finally:
            runner.close()
            pool.close()
            for w in workers:
                w.shutdown()
    lock, each = got[False], got[True]
    assert [(e.prompt_id, e.sample_index) for e in each.episodes] == [
        (f"g{i}", s) for i in range(3) for s in range(2)
    ]
    assert each.rewards == lock.rewards == [3.0] * 6
    for a, b in zip(each.episodes, lock.episodes, strict=True):
        np.testing.assert_array_equal(a.sampled, b.sampled)
        if bitwise:
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
        else:  # f32 round-off, up to the first near-tie drawn the other way
            same = int(np.cumprod(a.tokens == b.tokens).sum())
            np.testing.assert_allclose(a.logprobs[: same + 1], b.logprobs[: same + 1], atol=1e-5)


@pytest.mark.parametrize("per_episode", [False, True])
def test_jobs_played_at_once_over_two_workers_all_finish(tiny_weights, per_episode):
    """Three jobs' episodes at once (pipelined steps, an evaluation beside them), each within
    its own hold, their groups spread over two workers in exclusive mode: holds met in any order
    never wait for each other for good (see test_pool's opposite-order test)."""
    model, source = tiny_weights
    workers = [InferenceWorker(model, SCHED_CFG, weight_source=source) for _ in range(2)]
    pool = WorkerPool(workers, exclusive_jobs=True)
    runner = _runner(Again(), pool, per_episode=per_episode, max_turns=2)
    try:
        reqs, problems = _groups(6, samples=1)
        jobs = [runner.start(0, reqs[k::3], problems) for k in range(3)]
        played = [job.result(timeout=300) for job in jobs]
        assert [len(p.episodes) for p in played] == [2, 2, 2]
        assert all(r == 2.0 for p in played for r in p.rewards)
    finally:
        runner.close()
        pool.close()
        for w in workers:
            w.shutdown()


class Flaky:
    """Group g1's first reply raises, g2's hangs (until ``release``); g0's episodes play on."""

    def __init__(self):
        self.release = threading.Event()

    def reply(self, problem, answers, tools):
        if problem == "g1" and len(answers) == 1:
            raise ValueError("the environment broke")
        if problem == "g2" and len(answers) == 1:
            self.release.wait(timeout=120)
            return Reply(text="too late", reward=1.0)
        return Reply(text=f"again {len(answers)}", reward=float(len(answers)))


@pytest.mark.parametrize("per_episode", [False, True])
def test_an_environment_that_raises_or_hangs_ends_only_its_episodes(
    tiny_weights, per_episode, caplog
):
    """environment.timeout_s bounds a reply; a reply that raises or times out ends its episode
    with the error as its verdict and a NaN reward (its group is not trained on), is counted,
    and the other episodes play to the end."""
    model, source = tiny_weights
    workers = [InferenceWorker(model, SCHED_CFG, weight_source=source)]
    pool = WorkerPool(workers, exclusive_jobs=True)
    caplog.set_level(logging.WARNING)
    env = Flaky()
    runner = _runner(env, pool, per_episode=per_episode)
    runner.cfg = dataclasses.replace(runner.cfg, timeout_s=0.5)
    try:
        reqs, problems = _groups(3)
        played = runner.play(0, reqs, problems)
        assert played.rewards == [3.0, 3.0, None, None, None, None]
        details = [v.detail for v in played.verdicts]
        assert details[2:4] == ["environment: ValueError: the environment broke"] * 2
        assert all(
            d.startswith("environment: EnvironmentTimeout: no reply within") for d in details[4:]
        )
        assert {v.kind for v in played.verdicts[2:]} == {VerdictKind.INTERNAL_ERROR}
        for ep, first in zip(played.episodes[2:], played.first_turns[2:], strict=True):
            np.testing.assert_array_equal(ep.tokens, first.tokens)  # no turn after the failure
        assert runner.take_failures() == {"errors": 2, "timeouts": 2}
        assert runner.take_failures() == {"errors": 0, "timeouts": 0}
        runner.play(0, *_groups(3))  # again: counted again, but named once a run
        assert runner.take_failures() == {"errors": 2, "timeouts": 2}
        warned = [
            r.getMessage() for r in caplog.records if "environment call failed" in r.getMessage()
        ]
        assert len(warned) == 2, warned
    finally:
        env.release.set()
        runner.close()
        pool.close()
        for w in workers:
            w.shutdown()
