"""An episode is the model's turns exactly as sampled with the environment's replies between
them: the ids the trainer gets are the ids the engine produced, the replies are out of the loss,
and a turn generated from other tokens than the episode's is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlax_tpu.config.smollm2 import smollm2_gguf
from rlax_tpu.controller.episodes import episode_rollout
from rlax_tpu.models.tokenizer import Tokenizer
from rlax_tpu.types import FinishReason, Rollout, TrainBatch


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
