"""The compiled programs that produce a token's log-prob, shared by the inference engine and the
trainer's aligned replay (``models.scoring``).

Sharing them is what makes the replay bitwise by construction: both run the same jitted
function with the same shapes, so XLA compiles the same program on the host, whatever choices
(tiling from cache sizes, vector width, which ops fuse into a reduction) it makes there. Two
programs that compute the same math (a dense cache instead of pages, or the log-softmax in a
separate program) do *not* agree bitwise on every host: the vocabulary log-softmax is a
reduction whose rounding follows those choices.

What the guarantee still rests on, and no construction gives: a row's result depends only on
that row's inputs, not on its index in the batch or on the other rows. Every op is row-wise, but
whether a matmul kernel accumulates every row in the same order (a remainder row may take a
narrower vector or scalar path) is the host's XLA:CPU's choice. :func:`rows_are_independent`
checks it with the compiled programs themselves; the engine runs it at start-up and, where it
fails, reports log-probs that are bitwise only up to that round-off (one warning, and
``EngineStats.rows_bitwise`` = False).

``decode_program``   tokens/positions [N] (one token per row, -1 = padding row) -> sampled or
                     forced tokens and their two log-probs ([N] each), the cache with their keys/values;
                     a MoE model's experts of each row's token too ([L, N, k] int16).
``prefill_program``  tokens/positions [R, C] prompt chunks -> the cache with their keys/values
                     (no logits); a MoE model's experts of each token ([L, R, C, k] int16).
``copy_program``     page copies (copy-on-write).
``rows_are_independent``  the start-up check above.
"""

from __future__ import annotations

import collections
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from rlax_tpu.models.paged_cache import PagedKVCache, one_device
from rlax_tpu.models.sampling import sample
from rlax_tpu.models.sharding import constrain

# Incremented inside the traced functions, i.e. once per trace (= compilation); jax's cache is
# process-wide, so engines and replays with the same shapes share compiled programs.
TRACES: collections.Counter[str] = collections.Counter()


def idle_sampling(n: int) -> dict[str, np.ndarray]:
    """Sampling arrays [n] for rows that sample nothing: temperature 1, no filter, no forcing.
    ``decode_program`` takes them (as jax arrays) with any row filled in."""
    return dict(
        temperature=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32),
        seeds=np.zeros(n, np.uint32),
        sample_index=np.zeros(n, np.int32),
        token_index=np.zeros(n, np.int32),
        forced=np.full(n, -1, np.int32),
    )


@partial(jax.jit, static_argnames=("graphdef", "spans"), donate_argnames="cache")
def decode_program(
    state: nnx.State,
    cache: PagedKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    tables: jax.Array,
    sampling: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    spans: tuple[tuple[int, int], ...] = (),
) -> tuple[dict[str, jax.Array], PagedKVCache]:
    """tokens, positions [N]; tables [N, M]; sampling: :func:`idle_sampling`'s arrays [N]
    -> ({tokens, logprob_temperature_scaled, logprob_sampler} [N], and for a MoE model
    experts [L, N, k] int16, cache)."""
    TRACES["step"] += 1
    model = nnx.merge(graphdef, state)
    hidden, cache, routing = model.run(
        tokens[:, None], positions[:, None], cache.with_tables(tables, spans)
    )
    logits = model.logits(hidden)  # as transformer.step
    out = sample(logits[:, 0], **sampling, native=cache.native and one_device())
    # Replicated under a mesh, so every process of a multi-host engine reads every row's token
    # (a no-op on one device).
    out = {k: constrain(v, (None,)) for k, v in dataclasses.asdict(out).items()}
    if routing is not None:
        out["experts"] = _recorded(routing.experts[:, :, 0])
    return out, cache.with_tables(cache.block_tables)  # spans: no retrace


def _recorded(experts: jax.Array) -> jax.Array:
    """A MoE model's chosen experts as the engine records them: int16 (expert ids < 2^15),
    replicated so every process of a multi-host engine reads them."""
    return constrain(experts.astype(jnp.int16), (None,) * experts.ndim)


@partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def prefill_program(
    state: nnx.State,
    cache: PagedKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    tables: jax.Array,
    *,
    graphdef: nnx.GraphDef,
) -> tuple[PagedKVCache, jax.Array | None]:
    """tokens, positions [R, C]; tables [R, M] -> (the cache with the chunks' keys/values, a MoE
    model's experts of each token [L, R, C, k] int16 or None)."""
    TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    # The hidden states are dead.
    _, written, routing = model.run(tokens, positions, cache.with_tables(tables))
    experts = None if routing is None else _recorded(routing.experts)
    # The decode step's table shape: no retrace.
    return written.with_tables(cache.block_tables), experts


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
    return copy_program(cache, jnp.asarray(pairs[:, 0]), jnp.asarray(pairs[:, 1]))


def host_copy(x: jax.Array) -> np.ndarray:
    """``x`` in full on this host, also when its shards live on other processes' devices."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def rows_are_independent(
    state: nnx.State,
    cache: PagedKVCache,
    *,
    graphdef: nnx.GraphDef,
    prefill_rows: int = 0,
    prefill_len: int = 1,
) -> tuple[bool, PagedKVCache]:
    """Whether the compiled decode (and prefill) programs give a row bits that depend only on
    the row's inputs: the same token in every row, in the last row alone, and beside a row at the
    cache's last position must give the same log-probs; a prompt chunk in the first and in the
    last prefill row the same keys/values.

    Uses (and returns) the engine's own ``cache`` of N rows x M pages per sequence, before any
    sequence holds a page: it writes pages 1..M (finite values; pages are always written before
    they are read; with data shards, each shard's pages 1..M). Compiles the programs the engine
    compiles on its first steps anyway.
    """
    n, m = cache.block_tables.shape
    tables = jnp.tile(jnp.arange(1, m + 1, dtype=jnp.int32), (n, 1))
    sampling = idle_sampling(n)
    sampling["forced"][:] = 1
    sampling = {k: jnp.asarray(v) for k, v in sampling.items()}
    ok = True

    def decode(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        nonlocal cache
        out, cache = decode_program(
            state,
            cache,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            tables,
            sampling,
            graphdef=graphdef,
        )
        rows = [np.asarray(out[k]).view(np.int32) for k in sorted(out) if k != "experts"]
        if "experts" in out:  # [L, N, k] -> a row's experts
            experts = np.asarray(out["experts"]).astype(np.int32)
            rows += list(experts.transpose(1, 0, 2).reshape(n, -1).T)
        return np.stack(rows, axis=1)

    every = decode(np.full(n, 2), np.zeros(n))  # position 0, then 1: attention over 2 keys
    ok &= bool((every == every[:1]).all())
    every = decode(np.full(n, 3), np.ones(n))
    ok &= bool((every == every[:1]).all())
    alone = decode(np.full(n, 3), np.where(np.arange(n) == n - 1, 1, -1))
    ok &= bool((alone[-1] == every[0]).all())
    if n >= 2:  # beside a row at the cache's last position (block attention: every block runs)
        far = np.where(np.arange(n) == n - 1, 1, -1)
        far[0] = m * cache.page_size - 1
        ok &= bool((decode(np.full(n, 3), far)[-1] == every[0]).all())
    if prefill_rows >= 2:
        c = min(prefill_len, m * cache.page_size)
        pages = jnp.arange(1, 1 + -(-c // cache.page_size))
        written = []
        for row in (0, prefill_rows - 1):
            # The same local pages; with data shards, in the row's shard's block of the pool.
            shard = row * cache.shards // prefill_rows
            offset = shard * (cache.num_pages // cache.shards)
            tokens = np.zeros((prefill_rows, prefill_len), np.int32)
            positions = np.full((prefill_rows, prefill_len), -1, np.int32)
            tokens[row, :c] = np.arange(c) % 7 + 2
            positions[row, :c] = np.arange(c)
            cache, _ = prefill_program(
                state,
                cache,
                jnp.asarray(tokens),
                jnp.asarray(positions),
                tables[:prefill_rows],
                graphdef=graphdef,
            )
            written.append([host_copy(x) for x in cache.read_pages(pages + offset)])
        ok &= all(np.array_equal(a, b) for a, b in zip(written[0], written[1], strict=True))
    return ok, cache
