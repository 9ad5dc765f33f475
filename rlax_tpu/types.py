"""Plain data types that components exchange through the controller (DESIGN.md §2-3).

Components never import each other; they meet here. Arrays are numpy (host) arrays so these types
cross process and gRPC boundaries without a device.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

_frozen = dataclasses.dataclass(frozen=True, kw_only=True)


class FinishReason(enum.Enum):
    EOS = "eos"  # the model emitted an end-of-sequence or stop token
    LENGTH = "length"  # max_new_tokens reached
    ABORTED = "aborted"  # interrupted (weight reload, shutdown); the caller re-issues it
    STOP = "stop"  # one of the request's stop strings or stop token sequences was sampled


@_frozen
class Rollout:
    """One sampled completion of one prompt.

    ``tokens``, ``logprobs`` and ``versions`` have shape [T] (T = number of generated tokens).
    ``logprobs[t]`` is log μ(tokens[t] | prefix) under the behaviour policy μ the worker sampled
    from (see ``logprob_policy``). ``versions[t]`` is the weight version that produced token t;
    all equal unless the rollout continued across a reload.

    A multi-turn episode is one rollout whose tokens interleave the model's turns with the
    environment's replies: ``sampled`` [T] bool is False on the environment's tokens (their
    ``logprobs`` are 0 and their ``versions`` those of the turn before them), which the loss
    masks. None: every token was sampled.

    ``routes`` [S, L, k] int16: a MoE model's experts (k of each of L layers) at every position
    of the sequence the worker computed, S = P + any continuation the request carried + T
    (an episode's last turn: the whole episode), -1 where it computed none (the last token,
    positions whose pages it reused without their record). The trainer can force them (routing
    replay). None: a dense model.
    """

    prompt_id: str
    sample_index: int  # index within the prompt's group, 0..G-1
    prompt_tokens: np.ndarray  # [P] int32
    tokens: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    versions: np.ndarray  # [T] int64
    finish_reason: FinishReason
    logprob_policy: str = "temperature_scaled"  # which distribution ``logprobs`` are under
    sampled: np.ndarray | None = None  # [T] bool; None: every token was sampled
    routes: np.ndarray | None = None  # [S, L, k] int16, S >= P + T; None: no experts

    def __post_init__(self) -> None:
        t = len(self.tokens)
        if self.routes is not None and (
            np.ndim(self.routes) != 3 or len(self.routes) < len(self.prompt_tokens) + t
        ):
            raise ValueError(
                f"rollout {self.prompt_id}/{self.sample_index}: routes has shape "
                f"{np.shape(self.routes)}, expected (S, layers, k) with S >= prompt + tokens = "
                f"{len(self.prompt_tokens) + t}"
            )
        if len(self.logprobs) != t or len(self.versions) != t:
            raise ValueError(
                f"rollout {self.prompt_id}/{self.sample_index}: tokens, logprobs and versions "
                f"must have one entry per generated token, got {t}, {len(self.logprobs)}, "
                f"{len(self.versions)}"
            )
        if self.sampled is not None and np.shape(self.sampled) != (t,):
            raise ValueError(
                f"rollout {self.prompt_id}/{self.sample_index}: sampled has shape "
                f"{np.shape(self.sampled)}, expected ({t},) (one entry per token)"
            )

    @property
    def version(self) -> int:
        """The rollout's version for staleness: the oldest weights that produced any token."""
        if len(self.versions) == 0:
            raise ValueError(f"rollout {self.prompt_id}/{self.sample_index} has no tokens")
        return int(self.versions.min())


def staleness(consumer_version: int, rollout_version: int) -> int:
    """Staleness of a rollout consumed by the update ``consumer_version -> consumer_version + 1``."""
    if rollout_version > consumer_version:
        raise ValueError(
            f"rollout version {rollout_version} is newer than the consuming version {consumer_version}"
        )
    return consumer_version - rollout_version


class VerdictKind(enum.Enum):
    """What a verifier concluded about one rollout (Codeforces verdict names)."""

    ACCEPTED = "accepted"
    WRONG_ANSWER = "wrong_answer"
    PRESENTATION_ERROR = "presentation_error"
    TIME_LIMIT = "time_limit"
    MEMORY_LIMIT = "memory_limit"
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"
    OUTPUT_LIMIT = "output_limit"
    # The sandbox, a checker or the service failed: says nothing about the model's answer.
    INTERNAL_ERROR = "internal_error"


@_frozen
class Verdict:
    """The verifier's result for one rollout.

    ``time_s`` and ``memory_bytes`` are the largest CPU time and peak RSS of one test run (0 for
    math answers). ``score`` is in [0, 1]: 1 when accepted, else the fraction of tests passed
    (checkers may award partial points per test).
    """

    kind: VerdictKind
    detail: str = ""  # short and human-readable, e.g. "test 3: expected 5, got 4"
    time_s: float = 0.0
    memory_bytes: int = 0
    tests_passed: int = 0
    tests_total: int = 0
    score: float = 0.0

    @property
    def accepted(self) -> bool:
        return self.kind is VerdictKind.ACCEPTED

    @property
    def is_model_failure(self) -> bool:
        """False for accepted answers and for internal errors (which must not become rewards)."""
        return self.kind not in (VerdictKind.ACCEPTED, VerdictKind.INTERNAL_ERROR)


@_frozen
class TrainBatch:
    """One training step's rollouts, as the controller hands them to the trainer.

    Rows are group-major: B = N·G rows, row b is sample ``b % G`` of prompt ``b // G``.

    tokens: [B, L] int32. Row b holds its prompt (``prompt_lengths[b]`` tokens), then its
        completion (``completion_lengths[b]`` tokens), then padding (any value; ignored).
    prompt_lengths: [B] int32, >= 1.
    completion_lengths: [B] int32, >= 0 (an empty completion contributes no tokens).
    behaviour_logprobs: [B, T] float32, completion-aligned: entry [b, t] is log μ of completion
        token t of row b as the inference worker reported it (``Rollout.logprobs``); T >= the
        longest completion, entries past a row's completion are ignored.
    rewards: [B] float32 sequence rewards (after any shaping).
    versions: [B] int64, the weight version each rollout was generated with (``Rollout.version``).
    group_size: G.
    temperature: the sampling temperature the behaviour log-probs are under (the workers report
        log-softmax(logits / temperature)); the trainer scores π_old, π_θ and π_ref the same way.
    loss_mask: [B, T] float32 like behaviour_logprobs, 1 on the completion tokens the loss
        trains on and 0 on an environment's tokens within a multi-turn episode
        (``Rollout.sampled``); None: every completion token.
    routes: [B, L, layers, k] int16 like tokens: a MoE model's experts at each position as the
        worker chose them (``Rollout.routes``), -1 where it recorded none (padding included);
        the trainer forces them when ``trainer.routing_replay`` says so. None: none recorded.
    """

    tokens: np.ndarray
    prompt_lengths: np.ndarray
    completion_lengths: np.ndarray
    behaviour_logprobs: np.ndarray
    rewards: np.ndarray
    versions: np.ndarray
    group_size: int
    temperature: float = 1.0
    loss_mask: np.ndarray | None = None
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is not None:
            if np.shape(self.loss_mask) != np.shape(self.behaviour_logprobs):
                raise ValueError(
                    f"TrainBatch.loss_mask has shape {np.shape(self.loss_mask)}, expected "
                    f"behaviour_logprobs' {np.shape(self.behaviour_logprobs)}"
                )
            if not np.isin(self.loss_mask, (0.0, 1.0)).all():
                raise ValueError("TrainBatch.loss_mask must hold only 0 and 1")
        if np.ndim(self.tokens) != 2:
            raise ValueError(f"TrainBatch.tokens must be [B, L], got shape {np.shape(self.tokens)}")
        b, length = np.shape(self.tokens)
        if self.routes is not None and (
            np.ndim(self.routes) != 4 or np.shape(self.routes)[:2] != (b, length)
        ):
            raise ValueError(
                f"TrainBatch.routes has shape {np.shape(self.routes)}, expected ({b}, {length}, "
                "layers, k) (tokens' rows and columns)"
            )
        for name in ("prompt_lengths", "completion_lengths", "rewards", "versions"):
            if np.shape(getattr(self, name)) != (b,):
                raise ValueError(
                    f"TrainBatch.{name} has shape {np.shape(getattr(self, name))}, expected ({b},)"
                    " (one per row of tokens)"
                )
        if np.ndim(self.behaviour_logprobs) != 2 or len(self.behaviour_logprobs) != b:
            raise ValueError(
                f"TrainBatch.behaviour_logprobs has shape {np.shape(self.behaviour_logprobs)}, "
                f"expected ({b}, T)"
            )
        if self.group_size < 1 or b % self.group_size:
            raise ValueError(
                f"TrainBatch has {b} rows, not a multiple of group_size {self.group_size}"
            )
        if not self.temperature > 0:
            raise ValueError(f"TrainBatch.temperature must be > 0, got {self.temperature}")
        prompt, completion = np.asarray(self.prompt_lengths), np.asarray(self.completion_lengths)
        if b and (prompt.min() < 1 or completion.min() < 0):
            raise ValueError("TrainBatch: prompt_lengths must be >= 1 and completion_lengths >= 0")
        if b and (prompt + completion).max() > length:
            row = int(np.argmax(prompt + completion))
            raise ValueError(
                f"TrainBatch row {row}: prompt {prompt[row]} + completion {completion[row]} tokens "
                f"do not fit in tokens' {length} columns"
            )
        if b and completion.max() > np.shape(self.behaviour_logprobs)[1]:
            raise ValueError(
                f"TrainBatch.behaviour_logprobs has {np.shape(self.behaviour_logprobs)[1]} columns, "
                f"fewer than the longest completion ({completion.max()})"
            )

    @property
    def num_rows(self) -> int:
        return int(np.shape(self.tokens)[0])

    def completion_mask(self) -> np.ndarray:
        """[B, T] float32: 1 on the completion tokens the loss trains on (T = behaviour_logprobs'
        width)."""
        t = np.shape(self.behaviour_logprobs)[1]
        mask = (np.arange(t)[None, :] < np.asarray(self.completion_lengths)[:, None]).astype(
            np.float32
        )
        return mask if self.loss_mask is None else mask * np.asarray(self.loss_mask, np.float32)

    @classmethod
    def from_rollouts(
        cls,
        rollouts: list[Rollout],
        rewards: np.ndarray,
        *,
        group_size: int,
        temperature: float = 1.0,
        routes: bool = True,
    ) -> TrainBatch:
        """Packs group-major rollouts (right padding) into a TrainBatch; ``routes``: with
        their MoE routes, if any."""
        if not rollouts:
            raise ValueError("TrainBatch.from_rollouts: no rollouts")
        length = max(len(r.prompt_tokens) + len(r.tokens) for r in rollouts)
        width = max(1, max(len(r.tokens) for r in rollouts))
        tokens = np.zeros((len(rollouts), length), np.int32)
        logprobs = np.zeros((len(rollouts), width), np.float32)
        multi_turn = any(r.sampled is not None for r in rollouts)
        loss_mask = np.zeros((len(rollouts), width), np.float32) if multi_turn else None
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_tokens), len(r.tokens)
            tokens[i, :p], tokens[i, p : p + c] = r.prompt_tokens, r.tokens
            logprobs[i, :c] = r.logprobs
            if loss_mask is not None:
                loss_mask[i, :c] = 1.0 if r.sampled is None else np.asarray(r.sampled, bool)
        return cls(
            routes=_batch_routes(rollouts, length) if routes else None,
            tokens=tokens,
            prompt_lengths=np.array([len(r.prompt_tokens) for r in rollouts], np.int32),
            completion_lengths=np.array([len(r.tokens) for r in rollouts], np.int32),
            behaviour_logprobs=logprobs,
            rewards=np.asarray(rewards, np.float32),
            versions=np.array([r.version if len(r.tokens) else -1 for r in rollouts], np.int64),
            group_size=group_size,
            temperature=temperature,
            loss_mask=loss_mask,
        )


def _batch_routes(rollouts: list[Rollout], length: int) -> np.ndarray | None:
    """The rollouts' routes as TrainBatch.routes [B, length, layers, k] (-1 on padding and on
    rows without any); None when no rollout has routes."""
    first = next((r.routes for r in rollouts if r.routes is not None), None)
    if first is None:
        return None
    routes = np.full((len(rollouts), length, *np.shape(first)[1:]), -1, np.int16)
    for i, r in enumerate(rollouts):
        if r.routes is None:
            continue
        n = len(r.prompt_tokens) + len(r.tokens)
        if np.shape(r.routes) != (n, *np.shape(first)[1:]):
            raise ValueError(
                f"rollout {r.prompt_id}/{r.sample_index}: routes of shape "
                f"{np.shape(r.routes)} for {n} positions (prompt + tokens) with "
                f"{np.shape(first)[1:]} experts a position: a turn that continued a sequence "
                "goes into a batch as its episode"
            )
        routes[i, :n] = r.routes
    return routes
