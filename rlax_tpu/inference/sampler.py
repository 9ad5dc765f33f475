"""What a request asks of the sampler. The device math (Gumbel draws from per-request streams,
top-k / top-p, the two log-probs) is ``rlax_tpu.models.sampling``, which the trainer's replay
runs too. Which of the two a rollout reports is its request's ``logprob_policy`` (:data:`LOGPROB_POLICIES`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from rlax_tpu.config import InferenceConfig

# Name -> meaning; the name is recorded in Rollout.logprob_policy.
LOGPROB_POLICIES = {
    "temperature_scaled": "log softmax(logits / T) over the full vocabulary (no top-k/top-p)",
    "sampler": "log of the top-k/top-p renormalized distribution the token was drawn from",
}
LogprobPolicy = Literal["temperature_scaled", "sampler"]


class InvalidSampling(ValueError):
    """Sampling parameters out of range."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy decoding. Fields left None take
    the worker's config defaults (``inference.temperature`` ...) at submission."""

    temperature: float | None = None
    top_k: int | None = None  # 0: off
    top_p: float | None = None  # 1: off
    max_new_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # end a sample besides the model's EOS ids
    # End a sample (FinishReason.STOP) once its sampled tokens end with one of these sequences,
    # or their text (the worker's tokenizer, special tokens as text) holds one of these strings.
    # The tokens that completed it are kept: they were sampled, and training needs them.
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # do not stop on the EOS ids (benchmarks force lengths this way)
    seed: int = 0  # low 32 bits are used
    logprob_policy: LogprobPolicy = "temperature_scaled"

    def resolved(self, defaults: InferenceConfig) -> SamplingParams:
        """None fields replaced by the config's defaults."""
        return dataclasses.replace(
            self,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            max_new_tokens=(
                defaults.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens
            ),
        )

    def check(self, *, vocab_size: int, max_new_tokens: int) -> None:
        """Raises InvalidSampling naming the bad field (call on :meth:`resolved` params)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidSampling(f"temperature = {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InvalidSampling(f"top_k = {self.top_k}: must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSampling(f"top_p = {self.top_p}: must be in (0, 1]")
        if not 1 <= self.max_new_tokens <= max_new_tokens:
            raise InvalidSampling(
                f"max_new_tokens = {self.max_new_tokens}: must be in [1, {max_new_tokens}] "
                "(inference.max_new_tokens)"
            )
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidSampling(f"stop_token_ids {bad}: outside the vocabulary [0, {vocab_size})")
        bad = [q for q in self.stop_sequences if not q or not all(0 <= t < vocab_size for t in q)]
        if bad:
            raise InvalidSampling(
                f"stop_sequences {bad}: each a non-empty sequence of ids in [0, {vocab_size})"
            )
        if any(not s for s in self.stop):
            raise InvalidSampling(f"stop {list(self.stop)}: an empty string stops nothing")
        if self.logprob_policy not in LOGPROB_POLICIES:
            raise InvalidSampling(
                f"logprob_policy = {self.logprob_policy!r}: choose one of {sorted(LOGPROB_POLICIES)}"
            )
