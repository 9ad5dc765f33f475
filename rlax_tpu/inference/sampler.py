"""RL-grade sampling: temperature, top-k, top-p, a seeded RNG stream per token, and log-probs.

For every row the sampler sees f32 logits ``z`` [V] and returns, from those same logits:
  * the token: ``argmax(z_f + g)`` with ``g`` Gumbel noise from
    ``key = fold_in(fold_in(key(seed), sample_index), token_index)`` and ``z_f = z / T`` with the
    top-k / top-p filter applied (filtered entries = -inf). This is an exact draw from
    softmax(z_f), and the key depends only on (request seed, sample index, token index), never on
    the batch. ``T == 0`` means greedy: ``argmax(z)``, no noise.
  * ``logprob_temperature_scaled = log_softmax(z / T)[token]`` (``T == 0`` -> T = 1): the
    unmodified policy at temperature T, over the full vocabulary.
  * ``logprob_sampler = log_softmax(z_f)[token]``: the distribution actually sampled from (top-k /
    top-p renormalized). Equal to the former when no filter is active.
Which of the two a rollout reports is its request's ``logprob_policy`` (:data:`LOGPROB_POLICIES`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

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
            max_new_tokens=(defaults.max_new_tokens if self.max_new_tokens is None
                            else self.max_new_tokens),
        )  # fmt: skip

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
        if self.logprob_policy not in LOGPROB_POLICIES:
            raise InvalidSampling(
                f"logprob_policy = {self.logprob_policy!r}: choose one of {sorted(LOGPROB_POLICIES)}"
            )

    @property
    def filtered(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


@dataclasses.dataclass(frozen=True)
class SampleOut:
    tokens: jax.Array  # [N] int32
    logprob_temperature_scaled: jax.Array  # [N] f32
    logprob_sampler: jax.Array  # [N] f32


def _filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p on [N, V] logits; dropped entries become -inf. Ties with the last kept
    value are kept (a deterministic rule that never depends on the sort's tie order)."""
    v = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, top_k, v)[:, None]
    keep = (rank < k) & (before < top_p[:, None])
    last = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)
    cutoff = jnp.take_along_axis(ordered, last[:, None], axis=-1)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def sample(
    logits: jax.Array, *, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
    seeds: jax.Array, sample_index: jax.Array, token_index: jax.Array, filtered: bool,
) -> SampleOut:  # fmt: skip
    """logits [N, V] f32; temperature, top_p [N] f32; top_k, seeds, sample_index, token_index [N]
    int32. ``filtered`` (static) compiles the top-k/top-p sort in; without it the filter is off."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    scaled = logits / t
    narrowed = _filter(scaled, top_k, top_p) if filtered else scaled

    def noise(seed: jax.Array, i: jax.Array, j: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), j)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    gumbel = jax.vmap(noise)(seeds.astype(jnp.uint32), sample_index, token_index)
    drawn = jnp.argmax(narrowed + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    pick = tokens[:, None]
    lp_scaled = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), pick, axis=-1)[:, 0]
    lp_sampler = jnp.take_along_axis(jax.nn.log_softmax(narrowed, axis=-1), pick, axis=-1)[:, 0]
    return SampleOut(tokens, lp_scaled, lp_sampler)
