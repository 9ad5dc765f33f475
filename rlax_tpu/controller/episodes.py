"""Multi-turn episodes (``environment.name``): each sampled first turn is played out with the
run's environment, and the trainer gets one Rollout per episode whose tokens are the model's turns
exactly as sampled with the environment's messages between them (tokenized once, with the chat
template's turn markers: ``Tokenizer.turn_ids``; out of the loss).

A next turn is a request that continues the episode's sequence (``Request.continuation``: the
engine feeds the tokens it holds like a preempted sequence's, so the keys, values and log-probs
are bitwise those of one uninterrupted sequence and the trainer's replay reproduces them), with
the version of the step and a sampling stream of its own (seed, "turn", group, sample, turn).
Every turn but the last keeps its pages (``Request.keep_pages``) and the turns of a group go to
one worker (``Request.session``), so a next turn computes only the reply and what follows.
An episode is a pure function of its seeds, version and the environment: one in flight when the
run stops is played again from its first turn on resume, as a single-turn group is re-issued.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from rlax_tpu.config import EnvironmentConfig
from rlax_tpu.controller import tasks as tasks_lib
from rlax_tpu.controller.ports import VerifierPort
from rlax_tpu.data.mixture import stream_seed
from rlax_tpu.data.problems import Problem
from rlax_tpu.environments import Environment, Tools, episode_reward
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.types import Rollout, Verdict
from rlax_tpu.verifiers.api import RunTask

_SEP = "\x1f"  # between a group key and a sample index in a turn's prompt_id


def episode_rollout(
    turns: Sequence[Rollout], replies: Sequence[Sequence[int]], *, prompt_id: str, sample_index: int
) -> Rollout:
    """The episode of ``turns`` (the model's, oldest first; turn k + 1 continued the sequence
    of the episode's prompt, turns 0..k and the environment's ``replies[0..k]``, as
    ``Request.continuation``) as one Rollout of the first turn's prompt: tokens turn 0,
    reply 0, turn 1, ...; ``sampled`` False on the replies, whose log-probs are 0 and whose
    versions are those of the turn before them.

    ValueError if a turn was generated from another prompt, or a reply is missing."""
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
            if not np.array_equal(np.asarray(turn.prompt_tokens, np.int32), prompt):
                raise ValueError(
                    f"turn {k} of episode {prompt_id}/{sample_index} was generated from "
                    "another prompt than the episode's"
                )
        tokens.append(np.asarray(turn.tokens, np.int32))
        logprobs.append(np.asarray(turn.logprobs, np.float32))
        versions.append(np.asarray(turn.versions, np.int64))
        sampled.append(np.ones(len(turn.tokens), bool))
    tokens = np.concatenate(tokens)
    routes = turns[-1].routes  # the last turn's sequence is the whole episode's
    if routes is not None and len(routes) != len(prompt) + len(tokens):
        raise ValueError(
            f"episode {prompt_id}/{sample_index}: its last turn's routes cover {len(routes)} "
            f"positions, the episode has {len(prompt) + len(tokens)}"
        )
    return Rollout(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=prompt,
        tokens=tokens,
        routes=routes,
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

    def run(self, code: str, *, language: str = "python", stdin: str = "") -> Verdict:
        [verdict] = self.verifier.verify([RunTask(language=language, code=code, stdin=stdin)])
        return verdict


@dataclasses.dataclass
class _Episode:
    problem: Problem
    turns: list[Rollout]
    replies: list[list[int]] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    verdict: Verdict | None = None

    @property
    def held(self) -> list[int]:
        """Every token after the prompt so far: turns and replies."""
        out: list[int] = []
        for k, turn in enumerate(self.turns):
            if k:
                out += self.replies[k - 1]
            out += turn.tokens.tolist()
        return out


class EpisodeRunner:
    """Plays sampled first turns out as episodes of ``env``."""

    def __init__(
        self,
        env: Environment,
        tools: Tools,
        tokenizer: object,  # has turn_ids and decode (models.Tokenizer)
        cfg: EnvironmentConfig,
        *,
        generate: Callable[[int, Sequence[Request]], list[Rollout]],
        seed: int,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        threads: int = 8,
    ):
        self.env, self.tools, self.tokenizer, self.cfg = env, tools, tokenizer, cfg
        self.generate, self.seed, self.max_new_tokens = generate, seed, max_new_tokens
        self.stop_token_ids = tuple(stop_token_ids)
        self._threads = cf.ThreadPoolExecutor(threads, "episode")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def first_turn(self, request: Request) -> Request:
        """A group's request as its episodes' first turn: capped at ``turn_tokens``, its pages
        kept for the next turn, its continuations routed to its worker (session = its key)."""
        sampling = request.sampling
        if self.cfg.turn_tokens:  # leave room for the next turns
            sampling = dataclasses.replace(sampling, max_new_tokens=self.cfg.turn_tokens)
        return dataclasses.replace(
            request,
            sampling=sampling,
            keep_pages=self.cfg.max_turns > 1,
            session=request.prompt_id,
        )

    def run(
        self, version: int, items: Sequence[tuple[Problem, Rollout]]
    ) -> tuple[list[Rollout], list[Verdict], list[float | None], list[float]]:
        """(episode rollouts, the last turn's verdicts, episode rewards (None: the verifier
        failed), the first turns' rewards), in the order of ``items`` (each a problem and its
        sampled first turn)."""
        episodes = [_Episode(problem, [first]) for problem, first in items]
        active = list(range(len(episodes)))
        while active:
            replies = list(
                self._threads.map(
                    lambda i: self.env.reply(
                        episodes[i].problem,
                        [self.tokenizer.decode(t.tokens.tolist()) for t in episodes[i].turns],
                        self.tools,
                    ),
                    active,
                )
            )
            requests, waiting = [], []
            for i, reply in zip(active, replies, strict=True):
                ep = episodes[i]
                ep.rewards.append(reply.reward)
                ep.verdict = reply.verdict
                if reply.text is None or len(ep.turns) >= self.cfg.max_turns:
                    continue
                if math.isnan(reply.reward):
                    continue
                ids = self.tokenizer.turn_ids(reply.text, after=ep.turns[-1].tokens.tolist())
                held = [*ep.held, *ids]
                room = self.max_new_tokens - len(held)
                if room < 1:  # the episode's token budget is spent
                    continue
                room = min(room, self.cfg.turn_tokens or room)
                ep.replies.append(ids)
                first = ep.turns[0]
                key = first.prompt_id
                requests.append(
                    Request(
                        prompt_id=f"{key}{_SEP}{first.sample_index}",
                        prompt_tokens=tuple(int(t) for t in first.prompt_tokens),
                        continuation=tuple(held),
                        keep_pages=len(ep.turns) + 1 < self.cfg.max_turns,
                        session=key,
                        sampling=SamplingParams(
                            seed=stream_seed(
                                self.seed, "turn", key, first.sample_index, len(ep.turns)
                            )
                            & 0xFFFFFFFF,
                            stop_token_ids=self.stop_token_ids,
                            max_new_tokens=room,
                        ),
                    )
                )
                waiting.append(i)
            if not requests:
                break
            by_id = {ro.prompt_id: ro for ro in self.generate(version, requests)}
            for i, req in zip(waiting, requests, strict=True):
                episodes[i].turns.append(by_id[req.prompt_id])
            active = waiting
        rollouts = [
            episode_rollout(
                ep.turns,
                ep.replies,
                prompt_id=ep.turns[0].prompt_id,
                sample_index=ep.turns[0].sample_index,
            )
            for ep in episodes
        ]
        rewards = [
            None
            if any(math.isnan(r) for r in ep.rewards)
            else episode_reward(ep.rewards, mode=self.cfg.reward, discount=self.cfg.discount)
            for ep in episodes
        ]
        verdicts = [ep.verdict or tasks_lib.NO_PROGRAM for ep in episodes]
        return rollouts, verdicts, rewards, [ep.rewards[0] for ep in episodes]
