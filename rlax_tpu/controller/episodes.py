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

Scheduling (``EpisodeRunner``): one by one, each episode moves on when its own turn or reply is
ready (a group's first turns stream out of the pool as the group finishes); or lock-step, a
job's turns k all generated before any reply to them. A job's turns run within one hold of its
version on their workers (``WorkerPool.hold``), ahead of newer versions' jobs.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlax_tpu.config import EnvironmentConfig
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller import tasks as tasks_lib
from rlax_tpu.controller.epochs import Hold
from rlax_tpu.controller.pool import WorkerPool
from rlax_tpu.controller.ports import VerifierPort
from rlax_tpu.data.mixture import stream_seed
from rlax_tpu.data.problems import Problem
from rlax_tpu.environments import Environment, Reply, Tools, episode_reward
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.types import Rollout, Verdict, VerdictKind
from rlax_tpu.verifiers.api import RunTask

log = logging.getLogger(__name__)

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
        # Every verdict given, for an evaluation to take its first turns' from (groups.verify).
        self.memo = groups_lib.VerdictMemo()

    def verify(self, problem: Problem, answer: str) -> Verdict:
        task = tasks_lib.make_task(
            problem, answer, style=self.style, specs=self.specs, language=self.language
        )
        if task is None:
            return tasks_lib.NO_PROGRAM
        [verdict] = self.verifier.verify([task])
        self.memo.put(groups_lib.task_key(problem, task), verdict)
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


@dataclasses.dataclass
class Played:
    """A job's episodes, each list in the job's order (its requests', then sample index)."""

    first_turns: list[Rollout]
    episodes: list[Rollout]
    verdicts: list[Verdict]  # the last turn's
    rewards: list[float | None]  # the episode's (None: the verifier failed on a turn)
    first_rewards: list[float]  # the first turn's


class _Playing:
    """The episodes of one job played one by one: which have started, how many are left; its
    future gets them all, or the first error."""

    def __init__(self, total: int):
        self.lock = threading.Lock()
        self.episodes: dict[tuple[str, int], _Episode] = {}
        self.left = total
        self.done: cf.Future[list[_Episode]] = cf.Future()
        if total == 0:
            self.done.set_result([])

    def add(self, first: Rollout, problem: Problem) -> _Episode | None:
        """The episode of ``first`` if new (a group generated again after a failover is not)."""
        with self.lock:
            key = (first.prompt_id, first.sample_index)
            if key in self.episodes or self.done.done():
                return None
            self.episodes[key] = ep = _Episode(problem, [first])
            return ep

    def finish(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left or self.done.done():
                return
            self.done.set_result(list(self.episodes.values()))

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if not self.done.done():
                self.done.set_exception(error)


class EpisodeRunner:
    """Plays a job's first turns out as episodes of ``env`` on the workers of ``pool``.

    ``per_episode`` (asked once, at the first job): each episode's environment call starts as
    soon as its turn is generated and its next turn is submitted as soon as the reply is ready,
    with at most ``cfg.concurrency`` environment calls at once; else (lock-step) every turn k of
    the job is generated before any environment call on it, and the next turns go together.
    Either way a job's turns run within one hold of its version (``WorkerPool.hold``), ahead
    of jobs of newer versions on their workers.
    """

    def __init__(
        self,
        env: Environment,
        tools: Tools,
        tokenizer: object,  # has turn_ids and decode (models.Tokenizer)
        cfg: EnvironmentConfig,
        *,
        pool: WorkerPool,
        seed: int,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        per_episode: Callable[[], bool] | bool = True,
    ):
        self.env, self.tools, self.tokenizer, self.cfg = env, tools, tokenizer, cfg
        self.pool, self.seed, self.max_new_tokens = pool, seed, max_new_tokens
        self.stop_token_ids = tuple(stop_token_ids)
        self._per_episode = per_episode
        self._env_calls = cf.ThreadPoolExecutor(cfg.concurrency, "environment")
        # Lock-step jobs wait on a thread each (one per job in flight, throughput mode has many).
        self._drivers = cf.ThreadPoolExecutor(256, "lock-step")
        self._playing: set[_Playing] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.failures: collections.Counter[str] = collections.Counter()  # take_failures
        self._warned: set[str] = set()  # the kinds of failure named in a warning

    @property
    def per_episode(self) -> bool:
        with self._lock:
            if callable(self._per_episode):
                self._per_episode = bool(self._per_episode())
            return self._per_episode

    def close(self) -> None:
        self._env_calls.shutdown(wait=False, cancel_futures=True)
        self._drivers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            playing = list(self._playing)
        for state in playing:  # their cancelled environment calls would never finish them
            state.fail(RuntimeError("the episode runner was closed"))

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

    def play(
        self,
        version: int,
        requests: Sequence[Request],
        problems: Mapping[str, Problem],
        *,
        counted: bool = True,
    ) -> Played:
        """Generates ``requests`` (groups; ``problems`` by prompt_id) with ``version`` as first
        turns and plays each sample out as an episode."""
        return self.start(version, requests, problems, counted=counted).result()

    def start(
        self,
        version: int,
        requests: Sequence[Request],
        problems: Mapping[str, Problem],
        *,
        counted: bool = True,
    ) -> cf.Future[Played]:
        """``play`` without waiting: the first turns are submitted before it returns."""
        requests = [self.first_turn(r) for r in requests]
        total = sum(r.num_samples for r in requests)
        hold = self.pool.hold(version)
        try:
            if self.per_episode:
                playing = self._one_by_one(version, requests, problems, hold, counted, total)
            else:
                first = self.pool.submit(version, requests, counted=counted, hold=hold)
                playing = self._drivers.submit(
                    self._lock_step, version, first, problems, hold, counted, total
                )
        except BaseException:
            hold.release()
            raise
        out: cf.Future[Played] = cf.Future()

        def played(f: cf.Future[list[_Episode]]) -> None:
            hold.release()
            try:
                out.set_result(self._played(requests, f.result()))
            except BaseException as e:  # noqa: BLE001 - the caller's result() raises it
                out.set_exception(e)

        playing.add_done_callback(played)
        return out

    def _played(self, requests: list[Request], episodes: list[_Episode]) -> Played:
        order = {r.prompt_id: n for n, r in enumerate(requests)}
        episodes = sorted(
            episodes, key=lambda ep: (order[ep.turns[0].prompt_id], ep.turns[0].sample_index)
        )
        return Played(
            first_turns=[ep.turns[0] for ep in episodes],
            episodes=[
                episode_rollout(
                    ep.turns,
                    ep.replies,
                    prompt_id=ep.turns[0].prompt_id,
                    sample_index=ep.turns[0].sample_index,
                )
                for ep in episodes
            ],
            verdicts=[ep.verdict or tasks_lib.NO_PROGRAM for ep in episodes],
            rewards=[
                None
                if any(math.isnan(r) for r in ep.rewards)
                else episode_reward(ep.rewards, mode=self.cfg.reward, discount=self.cfg.discount)
                for ep in episodes
            ],
            first_rewards=[ep.rewards[0] for ep in episodes],
        )

    def _one_by_one(
        self,
        version: int,
        requests: list[Request],
        problems: Mapping[str, Problem],
        hold: Hold,
        counted: bool,
        total: int,
    ) -> cf.Future[list[_Episode]]:
        state = _Playing(total)
        with self._lock:
            if self._closed:
                raise RuntimeError("the episode runner is closed")
            self._playing.add(state)
        state.done.add_done_callback(lambda _: self._forget(state))

        def started(rollouts: list[Rollout]) -> None:  # a group's first turns, on a pool thread
            for ro in rollouts:
                ep = state.add(ro, problems[ro.prompt_id])
                if ep is not None:
                    submit_reply(ep)

        def submit_reply(ep: _Episode) -> None:
            try:
                self._env_calls.submit(reply, ep)
            except BaseException as e:  # noqa: BLE001 - closed: ends the job
                state.fail(e)

        def reply(ep: _Episode) -> None:  # on an environment thread
            try:
                request = self._next_turn(ep, self._reply(ep))
                if request is None:
                    state.finish()
                    return
                job = self.pool.submit(version, [request], counted=counted, hold=hold)
                job.add_done_callback(lambda f: turned(ep, f))
            except BaseException as e:  # noqa: BLE001 - the job's error
                state.fail(e)

        def turned(ep: _Episode, job: cf.Future[list[Rollout]]) -> None:
            try:
                [ro] = job.result()
            except BaseException as e:  # noqa: BLE001 - the job's error
                state.fail(e)
                return
            ep.turns.append(ro)
            submit_reply(ep)

        def first_turns(job: cf.Future[list[Rollout]]) -> None:
            try:
                started(job.result())  # any group the stream did not pass on
                _check_count(len(state.episodes), total)
            except BaseException as e:  # noqa: BLE001 - the job's error
                state.fail(e)

        try:
            job = self.pool.submit(version, requests, counted=counted, hold=hold, on_group=started)
        except BaseException as e:
            state.fail(e)  # forgotten: nothing of it runs
            raise
        job.add_done_callback(first_turns)
        return state.done

    def _forget(self, state: _Playing) -> None:
        with self._lock:
            self._playing.discard(state)

    def _lock_step(
        self,
        version: int,
        first: cf.Future[list[Rollout]],
        problems: Mapping[str, Problem],
        hold: Hold,
        counted: bool,
        total: int,
    ) -> list[_Episode]:
        episodes = [_Episode(problems[ro.prompt_id], [ro]) for ro in first.result()]
        _check_count(len(episodes), total)
        active = episodes
        while active:
            replies = list(self._env_calls.map(self._reply, active))
            nexts = [(ep, self._next_turn(ep, r)) for ep, r in zip(active, replies, strict=True)]
            nexts = [(ep, r) for ep, r in nexts if r is not None]
            if not nexts:
                break
            turns = self.pool.submit(
                version, [r for _, r in nexts], counted=counted, hold=hold
            ).result()
            by_id = {ro.prompt_id: ro for ro in turns}
            for ep, r in nexts:
                ep.turns.append(by_id[r.prompt_id])
            active = [ep for ep, _ in nexts]
        return episodes

    def _reply(self, ep: _Episode) -> Reply:
        answers = [self.tokenizer.decode(t.tokens.tolist()) for t in ep.turns]
        try:
            reply = bounded_call(
                self.env.reply, (ep.problem, answers, self.tools), self.cfg.timeout_s
            )
        except Exception as e:  # noqa: BLE001 - the environment's failure ends its episode only
            reply = self._failed(ep, e)
        ep.rewards.append(reply.reward)
        ep.verdict = reply.verdict
        return reply

    def _failed(self, ep: _Episode, error: Exception) -> Reply:
        """The reply of an environment call that raised or timed out: the episode ends, its
        NaN reward keeps its group out of the loss (as a verifier failure does)."""
        kind = "timeouts" if isinstance(error, EnvironmentTimeout) else "errors"
        detail = f"{type(error).__name__}: {error}"
        with self._lock:
            self.failures[kind] += 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:  # once per kind a run: every later one is counted in the metrics
            log.warning(
                "an environment call failed (%s, on %s turn %d): its episode ends and its group "
                "is not trained on; the run goes on (episode/environment_%s counts them)",
                detail,
                ep.turns[0].prompt_id,
                len(ep.turns),
                kind,
            )
        verdict = Verdict(kind=VerdictKind.INTERNAL_ERROR, detail=f"environment: {detail}")
        return Reply(text=None, reward=math.nan, verdict=verdict)

    def take_failures(self) -> dict[str, int]:
        """The environment calls that raised ("errors") or timed out ("timeouts") since the
        last call."""
        with self._lock:
            out, self.failures = self.failures, collections.Counter()
        return {k: out[k] for k in ("errors", "timeouts")}

    def _next_turn(self, ep: _Episode, reply: Reply) -> Request | None:
        """The request of the episode's next turn after ``reply`` (its tokens appended to the
        episode), or None: the episode is over."""
        if reply.text is None or len(ep.turns) >= self.cfg.max_turns:
            return None
        if math.isnan(reply.reward):
            return None
        ids = self.tokenizer.turn_ids(reply.text, after=ep.turns[-1].tokens.tolist())
        held = [*ep.held, *ids]
        room = self.max_new_tokens - len(held)
        if room < 1:  # the episode's token budget is spent
            return None
        room = min(room, self.cfg.turn_tokens or room)
        ep.replies.append(ids)
        first = ep.turns[0]
        key = first.prompt_id
        return Request(
            prompt_id=f"{key}{_SEP}{first.sample_index}",
            prompt_tokens=tuple(int(t) for t in first.prompt_tokens),
            continuation=tuple(held),
            keep_pages=len(ep.turns) + 1 < self.cfg.max_turns,
            session=key,
            sampling=SamplingParams(
                seed=stream_seed(self.seed, "turn", key, first.sample_index, len(ep.turns))
                & 0xFFFFFFFF,
                stop_token_ids=self.stop_token_ids,
                max_new_tokens=room,
            ),
        )


class EnvironmentTimeout(TimeoutError):
    """An environment call took longer than environment.timeout_s."""


def bounded_call(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """``fn(*args)``, or EnvironmentTimeout after ``timeout_s`` (0: no bound). The call runs on
    a daemon thread of its own, left behind if it hangs (Python cannot stop it): a bound pool's
    threads would all end up held by hung calls."""
    if not timeout_s:
        return fn(*args)
    done: cf.Future = cf.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)

    threading.Thread(target=run, name="environment-call", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except cf.TimeoutError:
        raise EnvironmentTimeout(
            f"no reply within environment.timeout_s = {timeout_s:g} s"
        ) from None


def _check_count(got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"a job's first turns came back as {got} samples, {want} were asked")
