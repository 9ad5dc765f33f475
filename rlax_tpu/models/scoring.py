"""Scoring given tokens the way the inference engine scored them when it sampled them.

``ReplayShape``       the engine's shapes that its programs are compiled for.
``rows_bitwise``      whether this host's programs round every row alike (what bitwise rests on).
``replay_logprobs``   the aligned π_old recompute (RLAX §5: it runs the inference graph): whole
                      rollouts through the engine's own programs (``models.programs``) at the
                      engine's shapes, on a paged cache of the engine's size. The prompt prefix
                      (all but the last prompt token) goes through the prefill program in
                      [prefill_rows, prefill_len] chunks at fixed boundaries, then every later
                      token through the decode program as one row of a [slots] batch, its
                      target forced. ``prefill_rows = 0``: every token as a decode row.

Bitwise on CPU by construction of the programs: the replay and the engine call the same jitted
functions with the same shapes, so they run the same compiled program; that a row's bits depend
only on its own inputs is checked per host (:func:`rows_bitwise`; ``models/programs.py``). XLA:CPU's matmuls and
reductions round differently for other shapes and other programs (another row count, a dense
cache, the log-softmax in a program of its own), so the replay pads to the engine's shapes and
never takes the cheapest one.

Rollout layout (as ``types.TrainBatch``): tokens [B, L] hold prompt (P_b tokens), completion
(C_b tokens), padding; log-probs are completion-aligned [B, T] (entry t scores completion token t).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.models import native_attention
from rlax_tpu.models.generate import check_token_ids
from rlax_tpu.models.paged_attention import resolve_backend
from rlax_tpu.models.paged_cache import PagedKVCache, page_bytes
from rlax_tpu.models.programs import (
    copy_pages,
    decode_program,
    idle_sampling,
    prefill_program,
    rows_are_independent,
)
from rlax_tpu.models.transformer import Transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayShape:
    """The engine's shapes that decide the bits: the rows of one decode step (``slots``; a
    smaller batch is padded with idle rows, larger ones are split), the paged cache (pages of
    ``page_size`` tokens, ``num_pages`` of them including the null page, ``pages_per_seq`` per
    sequence), the prefill program's [prefill_rows, prefill_len], and the attention backend."""

    slots: int
    page_size: int
    pages_per_seq: int
    num_pages: int
    prefill_rows: int = 0  # chunks per prefill call; 0: no prefill program
    prefill_len: int = 1  # tokens per chunk
    backend: str = "cpu"
    # CPU decode attention: pages per online-softmax block (paged_attention.block_attention);
    # 0 = every row over the whole cache.
    block_pages: int = 0
    # CPU decode attention by the native kernel (native_attention; inference.attention_kernel).
    native: bool = False
    # The engine's data shards (paged_cache.PagedKVCache.shards): its programs then run on a
    # mesh with that data degree, each shard on its block of rows and pages. 1: one pool.
    data_shards: int = 1

    @classmethod
    def of_engine(
        cls,
        cfg: InferenceConfig,
        model: ModelConfig,
        platform: str | None = None,
        data_shards: int = 1,
    ) -> ReplayShape:
        """The shapes of an engine built from ``cfg`` for a model of config ``model``, on
        ``platform`` (default: the one JAX runs on; it resolves ``backend = "auto"``), with
        ``data_shards`` (its mesh's data degree; the pages the budget holds are rounded down
        to a multiple of it)."""
        backend = resolve_backend(cfg.backend, platform)
        pages = cfg.kv_cache_bytes // page_bytes(model, cfg.page_size, backend)
        return cls(
            slots=cfg.step_tokens or cfg.max_concurrent_seqs,
            page_size=cfg.page_size,
            pages_per_seq=-(-(cfg.max_prompt_len + cfg.max_new_tokens) // cfg.page_size),
            num_pages=pages // data_shards * data_shards,
            prefill_rows=cfg.prefill_rows,
            prefill_len=cfg.prefill_len,
            backend=backend,
            block_pages=cfg.attention_block_pages if backend == "cpu" else 0,
            native=backend == "cpu" and native_kernel(cfg, model),
            data_shards=data_shards,
        )

    @property
    def cache_len(self) -> int:
        """KV positions per sequence."""
        return self.pages_per_seq * self.page_size

    def prefix(self, prompt_length: int) -> int:
        """Positions of a prompt the prefill program computes (all but the last token)."""
        return prompt_length - 1 if self.prefill_rows else 0

    def make_cache(self, model: ModelConfig) -> PagedKVCache:
        return PagedKVCache.create(
            model,
            num_pages=self.num_pages,
            page_size=self.page_size,
            batch=self.slots,
            pages_per_seq=self.pages_per_seq,
            backend=self.backend,
            block_pages=self.block_pages,
            native=self.native,
            shards=self.data_shards,
        )


def native_kernel(cfg: InferenceConfig, model: ModelConfig) -> bool:
    """Whether CPU decode rows take the native kernel: ``inference.attention_kernel`` resolved
    (``auto``: where it builds) and the model's attention shape one it is built for."""
    if cfg.attention_kernel == "xla":
        return False
    fits = native_attention.supports(
        model.resolved_head_dim, model.num_heads, model.num_kv_heads, jnp.dtype(model.compute_dtype)
    )
    if not fits:
        if cfg.attention_kernel == "native":
            raise ValueError(
                "inference.attention_kernel = 'native' supports f32 caches, head dims "
                f"{native_attention.HEAD_DIMS} and up to {native_attention.MAX_GROUP} query "
                "heads per KV head; use 'auto' or 'xla' for this model"
            )
        return False
    return native_attention.resolve(cfg.attention_kernel)


def rows_bitwise(model: Transformer, shape: ReplayShape) -> bool:
    """Whether, on this host, the programs at ``shape`` give each row bits that depend on its
    own inputs alone (``programs.rows_are_independent`` on a fresh cache): where False the
    replay matches the engine, and itself in another row order, only to f32 round-off."""
    graphdef, state = nnx.split(model)
    ok, _ = rows_are_independent(
        state,
        shape.make_cache(model.cfg),
        graphdef=graphdef,
        prefill_rows=shape.prefill_rows,
        prefill_len=shape.prefill_len,
    )
    return ok


def replay_logprobs(
    model: Transformer,
    tokens: np.ndarray,
    prompt_lengths: np.ndarray,
    completion_lengths: np.ndarray,
    *,
    shape: ReplayShape,
    temperature: float = 1.0,
    width: int | None = None,
) -> np.ndarray:
    """Completion log-probs [B, width] (default width: the longest completion), 0 past each
    completion, computed as the engine computes them (see the module docstring)."""
    tokens = np.asarray(tokens, np.int32)
    prompt = np.asarray(prompt_lengths, np.int64)
    completion = np.asarray(completion_lengths, np.int64)
    b = len(tokens)
    width = int(completion.max(initial=0)) if width is None else width
    out = np.zeros((b, width), np.float32)
    if b == 0 or width == 0:
        return out
    # Host-side checks: inside jit a too-long row's tail is dropped by the cache and an
    # out-of-range id gathers garbage, both silently.
    if prompt.shape != (b,) or completion.shape != (b,):
        raise ValueError(
            f"prompt_lengths {prompt.shape} and completion_lengths {completion.shape} must be "
            f"[B] = ({b},) for tokens of shape {tokens.shape}"
        )
    if (prompt < 1).any() or (completion < 0).any():
        raise ValueError("prompt lengths must be >= 1 and completion lengths >= 0")
    total = prompt + completion
    if total.max() > tokens.shape[1]:
        raise ValueError(
            f"a rollout of {total.max()} tokens is longer than the tokens array "
            f"({tokens.shape[1]} columns)"
        )
    live = np.arange(tokens.shape[1])[None, :] < total[:, None]
    check_token_ids(np.where(live, tokens, 0), model.cfg.vocab_size, "replay_logprobs: tokens")
    if total.max() > shape.cache_len:
        raise ValueError(
            f"a rollout of {total.max()} tokens does not fit the replay's "
            f"cache of {shape.cache_len} positions"
        )
    graphdef, state = nnx.split(model)
    cache = shape.make_cache(model.cfg)
    for rows in _groups(total, shape):
        tables = _tables(total[rows], shape)
        cache = _prefill(graphdef, state, cache, tokens[rows], prompt[rows], tables, shape)
        logp, cache = _decode(
            graphdef,
            state,
            cache,
            tokens[rows],
            prompt[rows],
            total[rows],
            tables,
            shape,
            temperature,
            width,
        )
        out[rows] = logp
    return out


def _pages(length: int, page: int) -> int:
    return max(1, -(-length // page))


def _groups(total: np.ndarray, shape: ReplayShape) -> list[np.ndarray]:
    """Consecutive rollouts, at most ``slots`` at a time and no more pages than the cache holds
    (the null page excluded); any one rollout fits, as it did in the engine."""
    groups, start, used = [], 0, 0
    for i, n in enumerate(total):
        need = _pages(int(n), shape.page_size)
        if i > start and (i - start == shape.slots or used + need > shape.num_pages - 1):
            groups.append(np.arange(start, i))
            start, used = i, 0
        used += need
    groups.append(np.arange(start, len(total)))
    return groups


def _tables(total: np.ndarray, shape: ReplayShape) -> np.ndarray:
    """[slots, pages_per_seq] block tables: rollout i gets its own pages from 1 on, in order,
    the null page past its end and in idle rows (as the engine lays out a sequence's table)."""
    tables = np.zeros((shape.slots, shape.pages_per_seq), np.int32)
    first = 1
    for i, n in enumerate(total):
        need = _pages(int(n), shape.page_size)
        tables[i, :need] = np.arange(first, first + need)
        first += need
    return tables


def _prefill(graphdef, state, cache, tokens, prompt, tables, shape):  # noqa: ANN001, ANN202
    """Writes every rollout's prompt prefix. Each distinct prefix (a group's G samples share
    one) is computed once into its first owner's pages, chunk k of up to ``prefill_rows``
    prefixes in call k, then copied to the other owners' pages (a prefix's keys/values do not
    depend on its row)."""
    if not shape.prefill_rows:
        return cache
    owners: dict[bytes, list[int]] = {}
    for i in range(len(tokens)):
        x = tokens[i, : shape.prefix(int(prompt[i]))]
        if len(x):
            owners.setdefault(x.tobytes(), []).append(i)
    distinct = list(owners.values())
    r, c, m = shape.prefill_rows, shape.prefill_len, shape.pages_per_seq
    for start in range(0, len(distinct), r):
        batch = [rows[0] for rows in distinct[start : start + r]]
        lengths = [shape.prefix(int(prompt[i])) for i in batch]
        call_tables = np.zeros((r, m), np.int32)
        call_tables[: len(batch)] = tables[batch]
        for a in range(0, max(lengths), c):
            chunk = np.zeros((r, c), np.int32)
            positions = np.full((r, c), -1, np.int32)
            for j, (i, n) in enumerate(zip(batch, lengths, strict=True)):
                stop = min(n, a + c)
                if stop > a:
                    chunk[j, : stop - a] = tokens[i, a:stop]
                    positions[j, : stop - a] = np.arange(a, stop)
            cache, _ = prefill_program(
                state,
                cache,
                jnp.asarray(chunk),
                jnp.asarray(positions),
                jnp.asarray(call_tables),
                graphdef=graphdef,
            )
    copies = []
    for rows in distinct:
        used = _pages(shape.prefix(int(prompt[rows[0]])), shape.page_size)
        copies += [
            (int(tables[rows[0], p]), int(tables[i, p])) for i in rows[1:] for p in range(used)
        ]
    return copy_pages(cache, copies)


def _decode(graphdef, state, cache, tokens, prompt, total, tables, shape, temperature, width):  # noqa: ANN001, ANN202, PLR0913
    """Step i feeds, in row b, the token at position q = prefix_b + i (rows at their own
    positions, as the engine's decode rows are) and scores the next one, forced: completion
    token q + 1 - P_b."""
    n, slots = len(tokens), shape.slots
    prefix = np.array([shape.prefix(int(x)) for x in prompt] + [0] * (slots - n))
    tokens = np.pad(tokens, ((0, slots - n), (0, 1)))  # idle rows; one spare column
    total = np.concatenate([total, np.zeros(slots - n, np.int64)])
    prompt = np.concatenate([prompt, np.ones(slots - n, np.int64)])
    length = tokens.shape[1]
    sampling = idle_sampling(slots)
    sampling["temperature"][:n] = temperature
    sampling = {k: jnp.asarray(v) for k, v in sampling.items()}
    tables = jnp.asarray(tables)
    out = np.zeros((slots, width), np.float32)
    span = total - 1 - prefix
    rows = np.arange(slots)
    for i in range(int(span.max())):
        q = prefix + i
        live = i < span
        fed = tokens[rows, np.minimum(q, length - 1)]
        targets = tokens[rows, np.minimum(q + 1, length - 1)]
        positions = np.where(live, q, -1)
        sampling["forced"] = jnp.asarray(targets.astype(np.int32))
        result, cache = decode_program(
            state,
            cache,
            jnp.asarray(fed.astype(np.int32)),
            jnp.asarray(positions, jnp.int32),
            tables,
            sampling,
            graphdef=graphdef,
        )
        t = q + 1 - prompt
        hit = live & (t >= 0) & (t < width)
        out[hit, t[hit]] = np.asarray(result["logprob_temperature_scaled"])[hit]
    return out[:n], cache
