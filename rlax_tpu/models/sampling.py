"""RL-grade sampling on device: temperature, top-k, top-p, a seeded RNG stream per token, log-probs.

For every row the sampler sees f32 logits ``z`` [V] and returns, from those same logits:
  * the token: ``argmax(z_f + g)`` with ``g`` Gumbel noise from
    ``key = fold_in(fold_in(key(seed), sample_index), token_index)`` and ``z_f = z / T`` with the
    top-k / top-p filter applied (filtered entries = -inf). This is an exact draw from
    softmax(z_f), and the key depends only on (request seed, sample index, token index), never on
    the batch. ``T == 0`` means greedy: ``argmax(z)``, no noise. A row with ``forced >= 0`` takes
    that token instead (scoring given tokens: the replay runs this very program).
  * ``logprob_temperature_scaled = log_softmax(z / T)[token]`` (``T == 0`` -> T = 1): the
    unmodified policy at temperature T, over the full vocabulary.
  * ``logprob_sampler = log_softmax(z_f)[token]``: the distribution actually sampled from (top-k /
    top-p renormalized). Equal to the former when no filter is active.

The filter is compiled into every program and runs (``lax.cond``) only when some row asks for it,
so a step with a filtered request runs the same program, bit for bit, as one without.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOut:
    tokens: jax.Array  # [N] int32
    logprob_temperature_scaled: jax.Array  # [N] f32
    logprob_sampler: jax.Array  # [N] f32


def top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p on [N, V] logits; dropped entries become -inf. Ties with the last kept
    value are kept (a deterministic rule that never depends on the sort's tie order). A row with
    top_k = 0 and top_p = 1 keeps every entry of nonzero probability."""
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
    seeds: jax.Array, sample_index: jax.Array, token_index: jax.Array, forced: jax.Array,
) -> SampleOut:  # fmt: skip
    """logits [N, V] f32; temperature, top_p [N] f32; top_k, seeds, sample_index, token_index,
    forced [N] int32 (forced < 0: sample)."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    scaled = logits / t
    wants_filter = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
    narrowed = jax.lax.cond(
        wants_filter, lambda: top_k_top_p(scaled, top_k, top_p), lambda: scaled
    )

    def noise(seed: jax.Array, i: jax.Array, j: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), j)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    gumbel = jax.vmap(noise)(seeds.astype(jnp.uint32), sample_index, token_index)
    drawn = jnp.argmax(narrowed + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    tokens = jnp.where(forced >= 0, forced, tokens)
    pick = tokens[:, None]
    lp_scaled = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), pick, axis=-1)[:, 0]
    lp_sampler = jnp.take_along_axis(jax.nn.log_softmax(narrowed, axis=-1), pick, axis=-1)[:, 0]
    return SampleOut(tokens, lp_scaled, lp_sampler)
