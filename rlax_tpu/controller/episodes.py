"""Multi-turn episodes as the trainer sees them: one Rollout per episode whose tokens are the
model's turns exactly as sampled with the environment's messages between them (tokenized once,
with the chat template's turn markers: ``Tokenizer.turn_ids``), and the tools an environment
borrows from the run (its verifier, grading an answer as a single-turn rollout is graded).

Not yet driven by the controller: a run is single-turn (issue [multi-turn]).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlax_tpu.controller import tasks as tasks_lib
from rlax_tpu.controller.ports import VerifierPort
from rlax_tpu.data.problems import Problem
from rlax_tpu.types import Rollout, Verdict


def episode_rollout(
    turns: Sequence[Rollout], replies: Sequence[Sequence[int]], *, prompt_id: str, sample_index: int
) -> Rollout:
    """The episode of ``turns`` (the model's, oldest first; turn k + 1 continued turn k's
    sequence after ``replies[k]``, the environment's token ids) as one Rollout of the first
    turn's prompt: tokens turn 0, reply 0, turn 1, ...; ``sampled`` False on the replies, whose
    log-probs are 0 and whose versions are those of the turn before them.

    ValueError if a turn's prompt is not the episode so far (the engine was not given exactly
    the tokens the episode holds, or a reply is missing)."""
    if not turns or len(replies) != len(turns) - 1:
        raise ValueError(
            f"an episode of {len(turns)} turns has {len(turns) - 1} replies between them, "
            f"got {len(replies)}"
        )
    prompt = np.asarray(turns[0].prompt_tokens, np.int32)
    tokens, logprobs, versions, sampled = [], [], [], []
    for k, turn in enumerate(turns):
        if k:
            reply = np.asarray(replies[k - 1], np.int32)
            tokens.append(reply)
            logprobs.append(np.zeros(len(reply), np.float32))
            last = versions[-1][-1:] if len(versions[-1]) else np.asarray([turn.version], np.int64)
            versions.append(np.repeat(last, len(reply)).astype(np.int64))
            sampled.append(np.zeros(len(reply), bool))
            so_far = np.concatenate([prompt, *tokens])
            if not np.array_equal(np.asarray(turn.prompt_tokens, np.int32), so_far):
                raise ValueError(
                    f"turn {k} of episode {prompt_id}/{sample_index} was generated from "
                    "another sequence than the episode's tokens so far"
                )
        tokens.append(np.asarray(turn.tokens, np.int32))
        logprobs.append(np.asarray(turn.logprobs, np.float32))
        versions.append(np.asarray(turn.versions, np.int64))
        sampled.append(np.ones(len(turn.tokens), bool))
    return Rollout(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=prompt,
        tokens=np.concatenate(tokens),
        logprobs=np.concatenate(logprobs),
        versions=np.concatenate(versions),
        finish_reason=turns[-1].finish_reason,
        logprob_policy=turns[-1].logprob_policy,
        sampled=np.concatenate(sampled),
    )


class VerifierTools:
    """An environment's tools (``rlax_tpu.environments.Tools``) over the run's verifier."""

    def __init__(
        self,
        verifier: VerifierPort,
        specs: tasks_lib.SpecCache,
        *,
        style: tasks_lib.PromptStyle,
        language: str = "python",
    ):
        self.verifier, self.specs, self.style, self.language = verifier, specs, style, language

    def verify(self, problem: Problem, answer: str) -> Verdict:
        task = tasks_lib.make_task(
            problem, answer, style=self.style, specs=self.specs, language=self.language
        )
        if task is None:
            return tasks_lib.NO_PROGRAM
        [verdict] = self.verifier.verify([task])
        return verdict
