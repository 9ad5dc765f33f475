"""Training samples drawn from an update's batch: which rows (seeded), what each holds, an
episode's turns split where the model's tokens and the environment's alternate."""

from __future__ import annotations

import numpy as np

from rlax_tpu.controller.groups import GroupResult
from rlax_tpu.controller.samples import draw, turns
from rlax_tpu.data.mixture import PromptRef
from rlax_tpu.types import FinishReason, Rollout


def _rollout(index: int, tokens: list[int], sampled: list[bool] | None = None) -> Rollout:
    n = len(tokens)
    return Rollout(
        prompt_id="p",
        sample_index=index,
        prompt_tokens=np.array([1, 2], np.int32),
        tokens=np.array(tokens, np.int32),
        logprobs=np.zeros(n, np.float32),
        versions=np.array([3] * (n - 1) + [4], np.int64),
        finish_reason=FinishReason.LENGTH if index else FinishReason.EOS,
        sampled=None if sampled is None else np.array(sampled),
    )


def _group(key: str, rollouts: list[Rollout]) -> GroupResult:
    ref = PromptRef(dataset="procedural", index=0, problem_id=key, epoch=0, ordinal=0)
    rewards = np.arange(len(rollouts), dtype=np.float64)
    return GroupResult(ref, rollouts, rewards, ["wrong_answer"] * len(rollouts))


def decode(tokens: np.ndarray) -> str:
    return " ".join(str(t) for t in tokens)


def test_an_episodes_turns_are_its_runs_of_model_and_environment_tokens():
    ro = _rollout(0, [10, 11, 20, 21, 22, 12], [True, True, False, False, False, True])
    assert turns(ro, decode) == [
        {"role": "model", "text": "10 11"},
        {"role": "environment", "text": "20 21 22"},
        {"role": "model", "text": "12"},
    ]


def test_samples_are_drawn_by_seed_and_step_and_carry_their_rows_advantage():
    groups = [
        _group("a", [_rollout(0, [5, 6]), _rollout(1, [7, 8, 9])]),
        _group("b", [_rollout(0, [10, 11, 20, 12], [True, True, False, True]), _rollout(1, [1])]),
    ]
    advantages = np.array([-1.0, 1.0, -2.0, 2.0], np.float32)
    kw = dict(k=2, seed=7, step=5, version=4, decode=decode)
    first = draw(groups, advantages, **kw)
    assert first == draw(groups, advantages, **kw)  # seeded
    picks = {
        tuple((x["group"], x["sample"]) for x in draw(groups, advantages, **(kw | {"step": s})))
        for s in range(8)
    }
    assert len(picks) > 1  # a step draws its own rows
    every = draw(groups, advantages, **(kw | {"k": 10}))  # at most the batch
    keys = ["procedural/a#0", "procedural/a#0", "procedural/b#0", "procedural/b#0"]
    assert [(s["group"], s["sample"]) for s in every] == list(zip(keys, [0, 1, 0, 1], strict=True))
    assert [s["advantage"] for s in every] == [-1.0, 1.0, -2.0, 2.0]
    assert [s["reward"] for s in every] == [0.0, 1.0, 0.0, 1.0]
    a1 = every[1]
    assert a1 == {
        "step": 5,
        "group": "procedural/a#0",
        "sample": 1,
        "prompt": "1 2",
        "completion": "7 8 9",
        "reward": 1.0,
        "advantage": 1.0,
        "verdict": "wrong_answer",
        "versions": [3, 4],
        "staleness": 1,  # against the update's starting version 4: the oldest token's 3
        "finish_reason": "length",
        "tokens": 3,
    }
    assert [t["role"] for t in every[2]["turns"]] == ["model", "environment", "model"]
    # Advantages that do not match the batch's rows are not guessed.
    assert all(s["advantage"] is None for s in draw(groups, advantages[:3], **kw))
    assert draw(groups, None, **(kw | {"k": 0})) == []
