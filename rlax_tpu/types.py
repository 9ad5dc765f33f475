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


@_frozen
class Rollout:
    """One sampled completion of one prompt.

    ``tokens``, ``logprobs`` and ``versions`` have shape [T] (T = number of generated tokens).
    ``logprobs[t]`` is log μ(tokens[t] | prefix) under the behaviour policy μ the worker sampled
    from (see ``logprob_policy``). ``versions[t]`` is the weight version that produced token t;
    all equal unless the rollout continued across a reload.
    """

    prompt_id: str
    sample_index: int  # index within the prompt's group, 0..G-1
    prompt_tokens: np.ndarray  # [P] int32
    tokens: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    versions: np.ndarray  # [T] int64
    finish_reason: FinishReason
    logprob_policy: str = "temperature_scaled"  # which distribution ``logprobs`` are under

    def __post_init__(self) -> None:
        t = len(self.tokens)
        if len(self.logprobs) != t or len(self.versions) != t:
            raise ValueError(
                f"rollout {self.prompt_id}/{self.sample_index}: tokens, logprobs and versions "
                f"must have one entry per generated token, got {t}, {len(self.logprobs)}, "
                f"{len(self.versions)}"
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
