"""Prompt groups: prompts -> generation requests, rollouts -> verified results -> a TrainBatch.

A group is one issue of a prompt (``PromptRef``, keyed by ``PromptRef.key``) with G samples.
Each sample's RNG stream is seeded from (run seed, group key), so a group's rollouts do not depend
on which worker generates it, what else shares the batch, or whether the run was restarted.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlax_tpu.algorithms import Objective
from rlax_tpu.algorithms import rewards as rewards_lib
from rlax_tpu.controller import tasks as tasks_lib
from rlax_tpu.controller.ports import VerifierPort
from rlax_tpu.data.mixture import PromptRef, stream_seed
from rlax_tpu.data.problems import Problem
from rlax_tpu.data.sources import Datasets
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.types import FinishReason, Rollout, TrainBatch, Verdict, VerdictKind

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GroupResult:
    """A verified group. rewards: [G] float64, NaN where the verifier failed (not the model)."""

    ref: PromptRef
    rollouts: list[Rollout]  # sorted by sample_index
    rewards: np.ndarray
    verdicts: list[str]  # VerdictKind values, one per sample
    issued_version: int = 0  # trainer version when the group was issued (throughput mode)
    # perf_counter stamps "launched", "generated", "verified" of its job (not snapshotted)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    replayed: str = ""  # drawn from the replay buffer: the pool ("recent", "reward", "uniform")
    # Multi-turn episodes: each sample's first turn's reward (a metric; not snapshotted).
    first_rewards: np.ndarray | None = None

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def version(self) -> int:
        return min(r.version for r in self.rollouts if len(r.tokens)) if self.generated else 0

    @property
    def generated(self) -> bool:
        return any(len(r.tokens) for r in self.rollouts)

    @property
    def verifier_failed(self) -> bool:
        return bool(np.isnan(self.rewards).any())

    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rollouts)

    def split_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able fields, arrays): snapshots keep the arrays out of their JSON. Per rollout
        arrays are concatenated over the group ([sum of lengths]) with their lengths."""
        rollouts, arrays = split_rollouts(self.rollouts)
        meta = {
            "ref": dataclasses.asdict(self.ref),
            "verdicts": list(self.verdicts),
            "issued_version": self.issued_version,
            "rollouts": rollouts,
        }
        return meta, arrays | {"rewards": np.asarray(self.rewards, np.float64)}

    @classmethod
    def from_split(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> GroupResult:
        rollouts = join_rollouts(meta["rollouts"], arrays)
        return cls(
            ref=PromptRef(**meta["ref"]),
            rollouts=rollouts,
            rewards=np.asarray(arrays["rewards"], np.float64).copy(),
            verdicts=list(meta["verdicts"]),
            issued_version=int(meta["issued_version"]),
        )

    # Snapshots before split_state held buffered groups as JSON (arrays as base64): still read.
    def state(self) -> dict[str, Any]:
        return {
            "ref": dataclasses.asdict(self.ref),
            "rollouts": [_rollout_state(r) for r in self.rollouts],
            "rewards": _pack(np.asarray(self.rewards, np.float64)),
            "verdicts": list(self.verdicts),
            "issued_version": self.issued_version,
        }

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> GroupResult:
        return cls(
            ref=PromptRef(**s["ref"]),
            rollouts=[_rollout_from_state(r) for r in s["rollouts"]],
            rewards=_unpack(s["rewards"]),
            verdicts=list(s["verdicts"]),
            issued_version=int(s["issued_version"]),
        )


def _pack(a: np.ndarray) -> dict[str, str]:
    return {
        "dtype": a.dtype.str,
        "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode(),
    }


def _unpack(d: dict[str, str]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).copy()


def split_rollouts(
    rollouts: Sequence[Rollout],
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """(JSON-able fields per rollout, arrays): each per-token array concatenated over the
    rollouts ([sum of lengths]) with its lengths ([R]), for msgpack."""
    meta = [
        {
            "prompt_id": r.prompt_id,
            "sample_index": r.sample_index,
            "finish_reason": r.finish_reason.value,
            "logprob_policy": r.logprob_policy,
        }
        | ({"multi_turn": True} if r.sampled is not None else {})
        | ({"routes": list(np.shape(r.routes)[1:])} if r.routes is not None else {})
        for r in rollouts
    ]
    arrays = {}
    for k, t in _ARRAYS.items():
        parts = [np.asarray(getattr(r, k), t) for r in rollouts]
        arrays[k] = np.concatenate(parts) if parts else np.zeros(0, t)
        arrays[f"{k}_lengths"] = np.asarray([len(p) for p in parts], np.int64)
    if any(r.sampled is not None for r in rollouts):  # single-turn state keeps its old layout
        arrays["sampled"] = np.concatenate([_sampled(r) for r in rollouts])
    routed = [np.asarray(r.routes, np.int16).reshape(-1) for r in rollouts if r.routes is not None]
    if routed:  # a MoE model's: each rollout's [S, layers, k] flattened, their sizes
        arrays["routes"] = np.concatenate(routed)
        arrays["routes_lengths"] = np.asarray([len(x) for x in routed], np.int64)
    return meta, arrays


def _sampled(r: Rollout) -> np.ndarray:
    return np.ones(len(r.tokens), bool) if r.sampled is None else np.asarray(r.sampled, bool)


def join_rollouts(meta: Sequence[dict[str, Any]], arrays: dict[str, np.ndarray]) -> list[Rollout]:
    """The inverse of :func:`split_rollouts`."""
    split = {
        k: np.split(np.asarray(arrays[k], t), np.cumsum(arrays[f"{k}_lengths"])[:-1])
        for k, t in _ARRAYS.items()
    }
    if "sampled" in arrays:
        cuts = np.cumsum(arrays["tokens_lengths"])[:-1]
        split["sampled"] = np.split(np.asarray(arrays["sampled"], bool), cuts)
    routed = iter([])
    if "routes" in arrays:
        cuts = np.cumsum(arrays["routes_lengths"])[:-1]
        routed = iter(np.split(np.asarray(arrays["routes"], np.int16), cuts))
    return [
        Rollout(
            **(
                {k: v for k, v in r.items() if k not in ("multi_turn", "routes")}
                | {k: split[k][i].copy() for k in _ARRAYS}
                | {"finish_reason": FinishReason(r["finish_reason"])}
                | ({"sampled": split["sampled"][i].copy()} if r.get("multi_turn") else {})
                | (
                    {"routes": next(routed).reshape(-1, *r["routes"]).copy()}
                    if "routes" in r
                    else {}
                )
            )
        )
        for i, r in enumerate(meta)
    ]


_ARRAYS = {
    "prompt_tokens": np.int32,
    "tokens": np.int32,
    "logprobs": np.float32,
    "versions": np.int64,
}


def _rollout_state(r: Rollout) -> dict[str, Any]:
    arrays = {k: _pack(np.asarray(getattr(r, k), t)) for k, t in _ARRAYS.items()}
    if r.sampled is not None:
        arrays["sampled"] = _pack(np.asarray(r.sampled, bool))
    if r.routes is not None:
        arrays["routes"] = _pack(np.asarray(r.routes, np.int16))
        arrays["routes_shape"] = list(np.shape(r.routes))
    return arrays | {
        "prompt_id": r.prompt_id,
        "sample_index": r.sample_index,
        "finish_reason": r.finish_reason.value,
        "logprob_policy": r.logprob_policy,
    }


def _rollout_from_state(s: dict[str, Any]) -> Rollout:
    arrays = {k: _unpack(s[k]) for k in (*_ARRAYS, "sampled", "routes") if k in s}
    if "routes" in s:
        arrays["routes"] = arrays["routes"].reshape(s["routes_shape"])
    fields = {k: v for k, v in s.items() if k != "routes_shape"}
    return Rollout(**(fields | arrays | {"finish_reason": FinishReason(s["finish_reason"])}))


class Prompter:
    """Problem lookup, prompt tokens and sampling seeds for prompt groups."""

    def __init__(
        self,
        datasets: Datasets,
        tokenizer: Any,
        *,
        style: tasks_lib.PromptStyle,
        language: str,
        group_size: int,
        seed: int,
        max_prompt_len: int,
        stop_token_ids: Sequence[int] = (),
        instructions: str = "",
    ):
        """``instructions``: the run's environment's (rlax_tpu.environments.instructions)."""
        self.datasets, self.tokenizer = datasets, tokenizer
        self.instructions = instructions
        self.style, self.language = style, language
        self.group_size, self.seed = group_size, seed
        self.max_prompt_len = max_prompt_len
        self.stop_token_ids = tuple(stop_token_ids)
        # By (source, id): two datasets may use the same ids.
        self._tokens: dict[tuple[str, str], np.ndarray] = {}

    def problem(self, ref: PromptRef) -> Problem:
        return self.datasets.problem(ref.dataset, ref.problem_id)

    def prompt_tokens(self, problem: Problem) -> np.ndarray:
        if (problem.source, problem.id) not in self._tokens:
            text = tasks_lib.prompt_text(
                problem,
                style=self.style,
                language=self.language,
                tokenizer=self.tokenizer,
                instructions=self.instructions,
            )
            ids = self.tokenizer.encode(text)
            self._tokens[problem.source, problem.id] = np.asarray(ids, np.int32)
        return self._tokens[problem.source, problem.id]

    def fits(self, problem: Problem) -> bool:
        return 0 < len(self.prompt_tokens(problem)) <= self.max_prompt_len

    def request(
        self, key: str, problem: Problem, *, num_samples: int | None = None, stream: str = "sample"
    ) -> Request:
        seed = stream_seed(self.seed, stream, key) & 0xFFFFFFFF
        return Request(
            prompt_id=key,
            prompt_tokens=self.prompt_tokens(problem),
            num_samples=num_samples or self.group_size,
            sampling=SamplingParams(seed=seed, stop_token_ids=self.stop_token_ids),
        )

    def completion(self, rollout: Rollout) -> str:
        return self.decode(rollout.tokens)

    def decode(self, tokens: np.ndarray) -> str:
        return self.tokenizer.decode(list(tokens))


class VerdictMemo:
    """Verdicts already given, by task identity (problem, kind, language, program or answer):
    an evaluation's first turns were graded by the episodes' environment (code_repair verifies
    each attempt) and are not run again, so pass@1 and the episode's first verdict agree.
    Internal errors are not kept (they say nothing of the answer); the oldest go past ``size``."""

    def __init__(self, size: int = 16384):
        self.size = size
        self._verdicts: collections.OrderedDict[tuple[str, ...], Verdict] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ...]) -> Verdict | None:
        with self._lock:
            return self._verdicts.get(key)

    def put(self, key: tuple[str, ...], verdict: Verdict) -> None:
        if verdict.kind is VerdictKind.INTERNAL_ERROR:
            return
        with self._lock:
            self._verdicts[key] = verdict
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > self.size:
                self._verdicts.popitem(last=False)


def verify(
    verifier: VerifierPort,
    specs: tasks_lib.SpecCache,
    prompter: Prompter,
    items: Sequence[tuple[Problem, Rollout]],
    memo: VerdictMemo | None = None,
) -> list[Verdict]:
    """One verdict per (problem, rollout); completions without a program are not run, nor
    those ``memo`` has a verdict for.

    Identical programs for the same problem are run once and share the verdict: a sharpened
    policy writes the same program in most samples of a group, and the sandbox is the slowest
    stage of a step on CPU. (A program whose result depends on chance gets one draw for all its
    copies in the call.)
    """
    batch: list[Any] = []
    slot: dict[tuple[str, ...], int] = {}  # task identity -> index in batch
    where: list[int | Verdict] = []  # item -> index in batch, -1 (no program) or the memo's
    for problem, rollout in items:
        task = tasks_lib.make_task(
            problem,
            prompter.completion(rollout),
            style=prompter.style,
            specs=specs,
            language=prompter.language,
        )
        if task is None:
            where.append(-1)
            continue
        key = task_key(problem, task)
        known = memo.get(key) if memo is not None else None
        if known is not None:
            where.append(known)
            continue
        if key not in slot:
            slot[key] = len(batch)
            batch.append(task)
        where.append(slot[key])
    ran = verifier.verify(batch) if batch else []
    if len(ran) != len(batch):
        raise RuntimeError(f"the verifier answered {len(ran)} verdicts for {len(batch)} tasks")
    if memo is not None:
        for key, j in slot.items():
            memo.put(key, ran[j])
    return [
        j if isinstance(j, Verdict) else tasks_lib.NO_PROGRAM if j < 0 else ran[j] for j in where
    ]


def task_key(problem: Problem, task: Any) -> tuple[str, ...]:
    """A task's identity: two equal keys get the same verdict."""
    text = getattr(task, "code", None) or getattr(task, "response", "")
    return (problem.id, type(task).__name__, getattr(task, "language", ""), text)


def rewards_of(
    reward: str,
    prompter: Prompter,
    items: Sequence[tuple[Problem, Rollout]],
    verdicts: Sequence[Verdict],
) -> list[float | None]:
    """The reward function ``reward``'s value per (problem, rollout); None: internal error."""
    fn = rewards_lib.reward_fn(reward)
    return [
        rewards_lib.score(
            fn,
            rewards_lib.RewardInput(
                verdict=v,
                tokens=ro.tokens,
                problem=problem,
                decode=prompter.decode,
                finished=ro.finish_reason is not FinishReason.LENGTH,
            ),
            name=reward,
        )
        for (problem, ro), v in zip(items, verdicts, strict=True)
    ]


def results_from(
    refs: Sequence[PromptRef],
    rollouts: Sequence[Rollout],
    verdicts: Sequence[Verdict],
    rewards: Sequence[float | None],
    *,
    issued_version: int = 0,
) -> list[GroupResult]:
    """Groups rollouts (prompt_id = group key), their verdicts and rewards (None: the verifier
    failed) into GroupResults (refs' order)."""
    by_key: dict[str, list[tuple[Rollout, Verdict, float | None]]] = {r.key: [] for r in refs}
    for ro, v, r in zip(rollouts, verdicts, rewards, strict=True):
        by_key[ro.prompt_id].append((ro, v, r))
    out = []
    for ref in refs:
        triples = sorted(by_key[ref.key], key=lambda p: p[0].sample_index)
        out.append(
            GroupResult(
                ref=ref,
                rollouts=[t[0] for t in triples],
                rewards=np.array([np.nan if t[2] is None else t[2] for t in triples], np.float64),
                verdicts=[t[1].kind.value for t in triples],
                issued_version=issued_version,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    batch: TrainBatch | None  # None: nothing left to train on
    trained: list[str]  # group keys in the batch
    filtered: list[str]  # dropped by dynamic sampling (uniform rewards)
    failed: list[str]  # dropped: the verifier failed on some sample
    surplus: list[str] = dataclasses.field(default_factory=list)  # kept beyond max_groups


def plan_batch(
    results: Sequence[GroupResult],
    objective: Objective,
    *,
    group_size: int,
    temperature: float,
    max_groups: int | None = None,
    routes: bool = True,
) -> BatchPlan:
    """The TrainBatch of a step: verifier failures dropped, dynamic sampling, at most
    ``max_groups`` kept groups (the first ones; DAPO trims a refilled batch to its size), reward
    shaping; ``routes``: with the rollouts' MoE routes (routing replay)."""
    ok = [r for r in results if not r.verifier_failed]
    failed = [r.key for r in results if r.verifier_failed]
    if not ok:
        return BatchPlan(None, [], [], failed)
    rewards = np.stack([r.rewards for r in ok])  # [N, G]
    keep, _ = objective.filter_groups(rewards)
    kept = [r for r, k in zip(ok, keep, strict=True) if k]
    filtered = [r.key for r, k in zip(ok, keep, strict=True) if not k]
    surplus = [r.key for r in kept[max_groups:]] if max_groups is not None else []
    kept = kept[: len(kept) - len(surplus)]
    if not kept:
        return BatchPlan(None, [], filtered, failed)
    rollouts = [ro for r in kept for ro in r.rollouts]
    lengths = np.array([len(ro.tokens) for ro in rollouts])
    shaped = objective.shape_rewards(np.concatenate([r.rewards for r in kept]), lengths)
    batch = TrainBatch.from_rollouts(
        rollouts, shaped, group_size=group_size, temperature=temperature, routes=routes
    )
    return BatchPlan(batch, [r.key for r in kept], filtered, failed, surplus)


def verdict_counts(results: Sequence[GroupResult]) -> dict[str, int]:
    counts = {k.value: 0 for k in VerdictKind}
    for r in results:
        for v in r.verdicts:
            counts[v] += 1
    return counts
