"""The compiled programs that produce a token's log-prob, shared by the inference engine and the
trainer's aligned replay (``models.scoring``).

Sharing them is what makes the replay bitwise by construction: both run the same jitted
function with the same shapes, so XLA compiles the same program on the host, whatever choices
(tiling from cache sizes, vector width, which ops fuse into a reduction) it makes there. Two
programs that compute the same math (a dense cache instead of pages, or the log-softmax in a
separate program) do *not* agree bitwise on every host: the vocabulary log-softmax is a
reduction whose rounding follows those choices.

What the guarantee still rests on: a row's result depends only on that row's inputs, not on its
index in the batch or the other rows (every op is row-wise; XLA:CPU's matmul and reduction
kernels accumulate each output in the same order for every row). The engine's tests check it
(a request alone against the same request in a full batch, bitwise).

``decode_program``   tokens/positions [N] (one token per row, -1 = padding row) -> sampled or
                     forced tokens and their two log-probs ([N] each), the cache with their keys/values.
``prefill_program``  tokens/positions [R, C] prompt chunks -> the cache with their keys/values
                     (no logits).
``copy_program``     page copies (copy-on-write).
"""

from __future__ import annotations

import collections
import dataclasses
from functools import partial

import jax
import numpy as np
from flax import nnx

from rlax_tpu.models.paged_cache import PagedKVCache
from rlax_tpu.models.sampling import sample
from rlax_tpu.models.transformer import step

# Incremented inside the traced functions, i.e. once per trace (= compilation); jax's cache is
# process-wide, so engines and replays with the same shapes share compiled programs.
TRACES: collections.Counter[str] = collections.Counter()


def idle_sampling(n: int) -> dict[str, np.ndarray]:
    """Sampling arrays [n] for rows that sample nothing: temperature 1, no filter, no forcing.
    ``decode_program`` takes them (as jax arrays) with any row filled in."""
    return dict(
        temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32), seeds=np.zeros(n, np.uint32),
        sample_index=np.zeros(n, np.int32), token_index=np.zeros(n, np.int32),
        forced=np.full(n, -1, np.int32),
    )  # fmt: skip


@partial(jax.jit, static_argnames=("graphdef", "spans"), donate_argnames="cache")
def decode_program(
    state: nnx.State, cache: PagedKVCache, tokens: jax.Array, positions: jax.Array,
    tables: jax.Array, sampling: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
    spans: tuple[tuple[int, int], ...] = (),
) -> tuple[dict[str, jax.Array], PagedKVCache]:  # fmt: skip
    """tokens, positions [N]; tables [N, M]; sampling: :func:`idle_sampling`'s arrays [N]
    -> ({tokens, logprob_temperature_scaled, logprob_sampler} [N], cache)."""
    TRACES["step"] += 1
    model = nnx.merge(graphdef, state)
    logits, cache = step(model, tokens[:, None], positions[:, None],
                         cache.with_tables(tables, spans))  # fmt: skip
    out = sample(logits[:, 0], **sampling)
    return dataclasses.asdict(out), cache.with_tables(cache.block_tables)  # spans: no retrace


@partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def prefill_program(
    state: nnx.State, cache: PagedKVCache, tokens: jax.Array, positions: jax.Array,
    tables: jax.Array, *, graphdef: nnx.GraphDef,
) -> PagedKVCache:  # fmt: skip
    """tokens, positions [R, C]; tables [R, M] -> the cache with the chunks' keys/values."""
    TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    _, written = model(tokens, positions, cache.with_tables(tables))  # the hidden states are dead
    return written.with_tables(cache.block_tables)  # the decode step's table shape: no retrace


@partial(jax.jit, donate_argnames="cache")
def copy_program(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """src, dst [K] page ids: page src[i] -> dst[i]; (0, 0) pairs are padding."""
    TRACES["copy"] += 1
    return cache.copy_pages(src, dst)


def copy_pages(cache: PagedKVCache, copies: list[tuple[int, int]]) -> PagedKVCache:
    """Runs :func:`copy_program` on ``copies`` (src, dst), padded to a power of two (few
    compilations)."""
    if not copies:
        return cache
    k = 1 << (len(copies) - 1).bit_length()
    pairs = np.zeros((k, 2), np.int32)  # (0, 0): the null page onto itself
    pairs[: len(copies)] = copies
    return copy_program(cache, jax.numpy.asarray(pairs[:, 0]), jax.numpy.asarray(pairs[:, 1]))
