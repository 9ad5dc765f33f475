"""RL-grade sampling on device: temperature, top-k, top-p, a seeded RNG stream per token, log-probs.

For every row the sampler sees f32 logits ``z`` [V] and returns, from those same logits:
  * the token: a draw from softmax(z_f), ``z_f = z / T`` with the top-k / top-p filter applied
    (filtered entries = -inf), by inverting its CDF at one uniform ``u`` from
    ``key = fold_in(fold_in(key(seed), sample_index), token_index)``: the key depends only on
    (request seed, sample index, token index), never on the batch. The CDF is summed in two
    levels (blocks of the vocabulary, then inside the chosen block), so a draw costs one
    exponential per entry and one random number per row, not a Gumbel variate per entry (that
    was a third of a SmolLM2 decode step on CPU). ``T == 0`` means greedy: ``argmax(z)``, no
    draw. A row with ``forced >= 0`` takes that token instead (scoring given tokens: the replay
    runs this very program).
  * ``logprob_temperature_scaled = log_softmax(z / T)[token]`` (``T == 0`` -> T = 1): the
    unmodified policy at temperature T, over the full vocabulary.
  * ``logprob_sampler = log_softmax(z_f)[token]``: the distribution actually sampled from (top-k /
    top-p renormalized). Equal to the former when no filter is active.
Each log-prob is ``(z[token] - max) - log(sum(exp(z - max)))``: the one entry the sampler needs,
not the whole log-softmax.

The filter is compiled into every program and runs (``lax.cond``) only when some row asks for it,
so a step with a filtered request runs the same program, bit for bit, as one without; likewise
the draw runs only when some row samples, and the argmax only when some row is greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rlax_tpu.models import native_attention


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


BLOCK = 512  # vocabulary entries per first-level CDF block


def _log_normalizer(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, V] -> (max [N], log(sum(exp(x - max))) [N]); rows of all -inf give max 0."""
    top = jnp.max(x, axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top, jnp.log(jnp.sum(jnp.exp(x - top[:, None]), axis=-1))


def _picked_logprob(
    x: jax.Array, top: jax.Array, log_sum: jax.Array, tokens: jax.Array
) -> jax.Array:
    picked = jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]
    return (picked - top) - log_sum


def first_max(x: jax.Array, top: jax.Array) -> jax.Array:
    """argmax over the last axis given the row max ``top`` [N]: the first index holding it, as
    one integer min-reduction (XLA:CPU's two-operand argmax reduction is several times slower).
    x [N, V] -> [N] int32 (a row without its max, e.g. NaN, gives 0)."""
    v = x.shape[-1]
    hit = jnp.where(x == top[:, None], jnp.arange(v, dtype=jnp.int32), v)
    return jnp.min(hit, axis=-1) % v


def inverse_cdf(x: jax.Array, top: jax.Array, u: jax.Array) -> jax.Array:
    """A draw from softmax(x) per row: the first index whose CDF exceeds u (u [N] in [0, 1)),
    never an entry of probability 0 (the last positive one if rounding leaves u past the sum).
    x [N, V] f32, top [N] its finite row max -> [N] int32."""
    n, v = x.shape
    blocks = -(-v // BLOCK)
    p = jnp.exp(x - top[:, None])  # [N, V], 0 where x = -inf
    p = jnp.pad(p, ((0, 0), (0, blocks * BLOCK - v))).reshape(n, blocks, BLOCK)
    block_mass = p.sum(axis=-1)  # [N, blocks]
    ends = jnp.cumsum(block_mass, axis=-1)
    target = u * ends[:, -1]
    last_block = blocks - 1 - jnp.argmax((block_mass > 0)[:, ::-1], axis=-1)
    block = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), last_block)
    before = (
        jnp.take_along_axis(ends, block[:, None], axis=-1)[:, 0]
        - jnp.take_along_axis(block_mass, block[:, None], axis=-1)[:, 0]
    )
    inner = jnp.take_along_axis(p, block[:, None, None], axis=1)[:, 0]  # [N, BLOCK]
    inner_ends = jnp.cumsum(inner, axis=-1)
    last = BLOCK - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    offset = jnp.minimum(jnp.sum(inner_ends <= (target - before)[:, None], axis=-1), last)
    return (block * BLOCK + offset).astype(jnp.int32)


def sample(
    logits: jax.Array,
    *,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    sample_index: jax.Array,
    token_index: jax.Array,
    forced: jax.Array,
    native: bool = False,
) -> SampleOut:
    """logits [N, V] f32; temperature, top_p [N] f32; top_k, seeds, sample_index, token_index,
    forced [N] int32 (forced < 0: sample). ``native`` (static; CPU, one device): each row's max,
    log-normalizer and first argmax from the native kernel
    (:func:`rlax_tpu.models.native_attention.logit_stats`, one multi-threaded pass instead of
    XLA:CPU's single-threaded reductions); the draw and the filter stay in XLA."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)
    zeros = jnp.zeros(logits.shape[0], jnp.int32)
    argmax_needed = jnp.any(greedy & (forced < 0))
    if native:
        top, log_sum, best = native_attention.logit_stats(logits, t)

        def scaled() -> jax.Array:
            return logits / t[:, None]

        def picked(tokens: jax.Array) -> jax.Array:  # greedy rows: exactly -log_sum
            z = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
            return (z / t - top) - log_sum
    else:
        x = logits / t[:, None]
        top, log_sum = _log_normalizer(x)
        # greedy rows have T = 1: x is the logits
        best = jax.lax.cond(argmax_needed, lambda: first_max(x, top), lambda: zeros)

        def scaled() -> jax.Array:
            return x

        def picked(tokens: jax.Array) -> jax.Array:
            return _picked_logprob(x, top, log_sum, tokens)

    wants_filter = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
    samples = ~greedy & (forced < 0)

    def uniform() -> jax.Array:
        def one(seed: jax.Array, i: jax.Array, j: jax.Array) -> jax.Array:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), j)
            return jax.random.uniform(key, (), jnp.float32)

        return jax.vmap(one)(seeds.astype(jnp.uint32), sample_index, token_index)

    def choose(x: jax.Array, x_top: jax.Array) -> jax.Array:
        drawn = jax.lax.cond(
            jnp.any(samples), lambda: inverse_cdf(x, x_top, uniform()), lambda: zeros
        )
        tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
        return jnp.where(forced >= 0, forced, tokens)

    def plain() -> tuple[jax.Array, jax.Array, jax.Array]:
        tokens = choose(scaled(), top)
        lp = picked(tokens)
        return tokens, lp, lp

    def filtered() -> tuple[jax.Array, jax.Array, jax.Array]:
        narrowed = top_k_top_p(scaled(), top_k, top_p)
        narrowed_top, narrowed_log_sum = _log_normalizer(narrowed)
        tokens = choose(narrowed, narrowed_top)
        return (
            tokens,
            picked(tokens),
            _picked_logprob(narrowed, narrowed_top, narrowed_log_sum, tokens),
        )

    # No [N, V] array leaves a branch: a cond's outputs are materialized.
    tokens, lp_scaled, lp_sampler = jax.lax.cond(wants_filter, filtered, plain)
    return SampleOut(tokens, lp_scaled, lp_sampler)
