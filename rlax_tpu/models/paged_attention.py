"""Paged attention, one implementation per backend, each reading its cache layout without a copy.

Split layout (cpu, gpu), per layer: ``k_pages``, ``v_pages`` [Hkv, P, page_size, D], the layout of
JAX's GPU Pallas paged-attention kernel. Combined layout (tpu, tpu_emulated), per layer:
``kv_pages`` [P, page_size, 2 * Hkv, D'] with the keys of head h at 2h and its values at 2h + 1,
the layout of JAX's TPU ragged paged-attention kernel (D' = D lane-padded to a multiple of 128,
zeros, which change no dot product). ``block_tables`` [B, M] int32 maps a sequence's page index
to a physical page (null page 0 past its end). Every backend computes, for query (b, t) at
``positions[b, t]`` = p >= 0, attention over positions 0..p of sequence b (the caller has already
written them); rows with p < 0 are padding and give finite, unspecified outputs.

* ``cpu``: gathers the block table's pages into a [B, S, Hkv, D] view (S = M * page_size) and runs
  :func:`rlax_tpu.models.dot_product_attention` with the causal mask by position. S and the math
  are those of ``DenseKVCache`` with ``max_len = S``: run op by op, its output is bitwise the
  dense cache's; inside a larger jitted program XLA may fuse the gather, so only to round-off.
  This is the reference, and the CPU path of prefill chunks. Decode rows (T = 1) take the
  native kernel (``rlax_tpu.models.native_attention``, ``inference.attention_kernel``) or, with
  ``inference.attention_block_pages`` > 0, :func:`block_attention`: an online softmax over
  blocks of pages up to the step's furthest position, without the gathered copy of the whole
  cache (8x less time per layer on SmolLM2 at 160 of 512 positions).
* ``tpu``: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, prefill and decode rows in
  one call: each batch row is one of the kernel's sequences, its valid tokens packed together
  (they must be consecutive positions at the start of the row, as the engine's decode and prefill
  rows are). Under a mesh it runs in shard_map (rows over the batch axes, heads over tensor).
* ``tpu_emulated``: the same layout, packing and sharding with a jittable XLA stand-in for the
  Mosaic kernel (:func:`emulated_ragged_kernel`), a named fake: the kernel cannot run here (JAX's
  TPU interpreter does not support its reshaped VMEM refs as of jax 0.10.2). Tests check the
  stand-in against JAX's own reference of the kernel, and the kernel itself is compiled for TPU by
  ``python -m rlax_tpu.aot``.
* ``gpu``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (one row per query token);
  ``gpu_interpret`` runs it in interpret mode, which is how the tests check it on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rlax_tpu.models.attention import causal_mask, dot_product_attention
from rlax_tpu.models.sharding import kernel_axes, manual_axes

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
_KV_BLOCK_BYTES = 2**20  # a ragged kernel block's keys and values, compiled off a TPU host


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[Hkv, P, page, D] pages, [B, M] tables -> [B, M * page, Hkv, D] in position order."""
    hkv, _, page, d = pages.shape
    b, m = block_tables.shape
    gathered = pages[:, block_tables]  # [Hkv, B, M, page, D]
    return gathered.transpose(1, 2, 3, 0, 4).reshape(b, m * page, hkv, d)


def reference_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """q [B, T, H, D] -> [B, T, H, D] (see the module docstring)."""
    k = gather_pages(k_pages, block_tables)
    v = gather_pages(v_pages, block_tables)
    stored = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=positions.dtype), k.shape[:2])
    return dot_product_attention(q, k, v, causal_mask(positions, stored))


def block_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    *,
    block_pages: int,
) -> jax.Array:
    """Decode attention straight over the pages, one block of ``block_pages`` pages at a time
    with an online softmax, up to the block holding the step's furthest position (a dynamic trip
    count): no gathered copy of the whole cache, and work that follows the rows' lengths, not
    the cache's. q [B, 1, H, D], pages [Hkv, P, page, D], tables [B, M], positions [B, 1] ->
    [B, 1, H, D] (padding rows: zeros).

    A row's bits do not depend on the trip count, so neither on the other rows: a block past
    the row's position has every score masked, and the update then leaves the running max,
    sum and output exactly as they were (factor exactly 1, weights exactly 0)."""
    b, t, h, d = q.shape
    if t != 1:
        raise ValueError(f"block_attention serves decode rows (T = 1), got T = {t}")
    hkv, _, page, _ = k_pages.shape
    m = block_tables.shape[1]
    blocks = -(-m // block_pages)
    tables = jnp.pad(block_tables, ((0, 0), (0, blocks * block_pages - m)))  # null page 0
    width = block_pages * page
    qg = q.reshape(b, hkv, h // hkv, d).astype(jnp.float32) * (1.0 / d**0.5)
    pos = positions[:, 0]
    trips = (jnp.max(pos) // width + 1).clip(0, blocks)  # 0 when every row is padding

    def body(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        top, total, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(tables, j * block_pages, block_pages, axis=1)
        k = k_pages[:, cols].reshape(hkv, b, width, d)  # [Hkv, B, block, D]
        v = v_pages[:, cols].reshape(hkv, b, width, d)
        scores = jnp.einsum("bkgd,kbsd->bkgs", qg, k, preferred_element_type=jnp.float32)
        seen = (j * width + jnp.arange(width))[None, :] <= pos[:, None]  # [B, block]
        seen = seen[:, None, None, :]
        scores = jnp.where(seen, scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        scale = jnp.where(new_top == top, 1.0, jnp.exp(top - new_top))
        weights = jnp.where(seen, jnp.exp(scores - new_top[..., None]), 0.0)
        total = total * scale + weights.sum(axis=-1)
        acc = acc * scale[..., None] + jnp.einsum(
            "bkgs,kbsd->bkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return new_top, total, acc

    shape = (b, hkv, h // hkv)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, d), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, trips, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, 1, h, d).astype(v_pages.dtype)


def span_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    spans: tuple[tuple[int, int], ...],
) -> jax.Array:
    """:func:`reference_attention` by consecutive row groups: ``spans`` = ((rows, pages), ...),
    rows summing to B; group j attends over its tables' first pages_j pages (its rows' positions
    must be < pages_j * page_size). :func:`reference_attention`'s output to f32 round-off: the
    dropped positions are masked there, but a shorter sum may be blocked in another order
    (``tests/models/test_paged_attention.py`` checks it)."""
    outs, start = [], 0
    for rows, pages in spans:
        stop = start + rows
        outs.append(
            reference_attention(
                q[start:stop],
                k_pages,
                v_pages,
                block_tables[start:stop, :pages],
                positions[start:stop],
            )
        )
        start = stop
    return jnp.concatenate(outs, axis=0)


def _flatten_queries(
    q: jax.Array, block_tables: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row per query token: (q [B*T, H, D] pre-scaled by 1/sqrt(D), tables [B*T, M],
    lengths [B*T] = p + 1, at least 1 so padding rows read the zeroed null page)."""
    b, t, h, d = q.shape
    scaled = (q.astype(jnp.float32) * (1.0 / d**0.5)).astype(q.dtype).reshape(b * t, h, d)
    tables = jnp.repeat(block_tables, t, axis=0)
    lengths = jnp.maximum(positions.reshape(b * t) + 1, 1).astype(jnp.int32)
    return scaled, tables, lengths


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(c for c in range(1, min(n, cap) + 1) if n % c == 0)


# Backends whose cache keeps keys and values in one combined array (see the module docstring).
COMBINED = ("tpu", "tpu_emulated")


def kernel_tiles(kv_heads: int, itemsize: int) -> bool:
    """Whether the TPU ragged kernel takes ``kv_heads`` KV heads per device: their 2 * kv_heads
    combined heads must fill whole sublane tiles (1, 2, 4, 8 or a multiple of 8 packed rows)."""
    combined, packing = 2 * kv_heads, max(1, 4 // itemsize)
    return combined % packing == 0 and (
        combined // packing in (1, 2, 4, 8) or combined // packing % 8 == 0
    )


def padded_kv_heads(kv_heads: int, itemsize: int) -> int:
    """KV heads the combined layout stores: the model's, padded with zero heads up to a count the
    kernel tiles (SmolLM2's 3 -> 4 in bf16; 8 stays 8)."""
    h = kv_heads
    while not kernel_tiles(h, itemsize):
        h += 1
    return h


def ragged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    *,
    kv_heads: int,
    emulated: bool = False,
    pages_by_rows: bool = False,
) -> jax.Array:
    """q [B, T, H, D], kv_pages [P, page_size, 2 * Hs, D'] (the model's ``kv_heads`` padded to
    Hs, see padded_kv_heads) -> [B, T, H, D] through the TPU ragged kernel (``emulated``: its
    XLA stand-in). ``pages_by_rows``: row b owns pages b*M .. b*M + M - 1 (M = the tables'
    width), so under a mesh the pages split over the batch axes with their rows."""
    h, stored = q.shape[2], kv_pages.shape[2] // 2
    # With zero KV heads padded in (padded_kv_heads), q gets zero heads too, at the end: the
    # kernel maps q head i to KV head i // (h / kv_heads), so the real heads keep their groups.
    ratio = h // kv_heads
    q = jnp.pad(q, ((0, 0), (0, 0), (0, stored * ratio - h), (0, 0)))
    call = partial(_ragged_rows, d=q.shape[-1], emulated=emulated)
    mesh = jax.sharding.get_abstract_mesh()
    auto = set(mesh.axis_names) - manual_axes(mesh)
    if not mesh.empty and math.prod(mesh.shape[a] for a in auto) > 1:
        # Mosaic kernels are not partitioned automatically: each device runs the kernel on its
        # rows (batch axes) and its heads (tensor axis), or on everything where they don't split.
        itemsize = kv_pages.dtype.itemsize
        rows, heads = kernel_axes(
            mesh, q.shape[0], q.shape[2], stored, lambda tp: kernel_tiles(stored // tp, itemsize)
        )
        if pages_by_rows and rows is not None:
            call = partial(_local_pages, call, rows)
        call = jax.shard_map(
            call,
            mesh=mesh,
            in_specs=(
                P(rows, None, heads, None),
                P(rows if pages_by_rows else None, None, heads, None),
                P(rows, None),
                P(rows, None),
            ),
            out_specs=P(rows, None, heads, None),
            axis_names=auto,
            check_vma=False,
        )
    return call(q, kv_pages, block_tables, positions)[:, :, :h]


def _local_pages(
    call: Callable,
    rows: str | tuple[str, ...],
    q: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """A device's rows own the device's pages (``pages_by_rows``): tables rebased to them."""
    first = jax.lax.axis_index(rows) * block_tables.size
    return call(q, kv_pages, block_tables - first.astype(jnp.int32), positions)


def _ragged_rows(
    q: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    *,
    d: int,
    emulated: bool,
) -> jax.Array:
    """One device's rows: packs their valid tokens (row b's at starts[b]..), rows with tokens
    first as the kernel's sequences, and unpacks the output."""
    b, t, h, _ = q.shape
    valid = positions >= 0
    q_lens = valid.sum(axis=1, dtype=jnp.int32)
    last = jnp.take_along_axis(positions, jnp.maximum(q_lens - 1, 0)[:, None], axis=1)[:, 0]
    kv_lens = jnp.where(q_lens > 0, last + 1, 0).astype(jnp.int32)
    # The kernel attends the first num_seqs sequences: rows with tokens, in row order, whose
    # packed queries then start where the running count of tokens (over all rows) says.
    order = jnp.argsort(q_lens == 0, stable=True)
    starts = jnp.cumsum(q_lens) - q_lens
    cu_q_lens = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens[order], dtype=jnp.int32)]
    )
    num_seqs = (q_lens > 0).sum(dtype=jnp.int32)[None]
    dest = jnp.where(valid, starts[:, None] + jnp.arange(t, dtype=jnp.int32), b * t)
    pad = kv_pages.shape[-1] - q.shape[-1]
    rows = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, pad))).astype(kv_pages.dtype)
    packed = jnp.zeros((b * t, h, kv_pages.shape[-1]), rows.dtype)
    packed = packed.at[dest.reshape(-1)].set(rows.reshape(b * t, h, -1), mode="drop")
    kernel = emulated_ragged_kernel if emulated else _mosaic_ragged_kernel
    out = kernel(
        packed, kv_pages, kv_lens[order], block_tables[order], cu_q_lens, num_seqs, sm_scale=d**-0.5
    )
    out = out[jnp.minimum(dest, b * t - 1)]  # [B, T, H, D']
    return jnp.where(valid[..., None, None], out, 0)[..., :d].astype(kv_pages.dtype)


def _mosaic_ragged_kernel(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    blocks: dict[str, int] = {}
    if jax.default_backend() != "tpu":
        # Compiling for a TPU from another host (python -m rlax_tpu.aot): the kernel's tuned
        # table keys on the local device, so take its untuned default (32 pages, 32 queries a
        # block), with fewer pages where a block's keys and values would pass 1 MiB: 32 pages
        # of the v5p preset's (64 tokens x 2 KV heads x 128 in bf16 a device) compile; the
        # v5p_moe trainer's 4 KV heads a device made 4 MiB blocks, which double-buffered ran
        # out of scoped VMEM (CompileTimeScopedVmemOom). A TPU host looks up tuned sizes itself.
        page_bytes = math.prod(kv_pages.shape[1:]) * kv_pages.dtype.itemsize
        pages = min(page_indices.shape[1], 32, _KV_BLOCK_BYTES // page_bytes)
        blocks = dict(
            num_kv_pages_per_block=max(1, pages),
            num_queries_per_block=min(q.shape[0], 32),
        )
    return ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, **blocks
    )


def emulated_ragged_kernel(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    """The TPU ragged kernel's contract, in jittable XLA (a fake for CPU tests, see the module
    docstring): packed token n of sequence s < num_seqs (cu_q_lens[s] <= n < cu_q_lens[s + 1])
    is at position kv_lens[s] - q_len[s] + (n - cu_q_lens[s]) and attends over positions up to
    it of s's pages. q [N, H, D'], kv_pages [P, page, 2 * Hkv, D'] -> [N, H, D'] (tokens past
    the last sequence's: zeros)."""
    n, h, d = q.shape
    _, page, combined, _ = kv_pages.shape
    hkv, m = combined // 2, page_indices.shape[1]
    token = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, kv_lens.shape[0] - 1)
    live = token < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (token - cu_q_lens[seq])
    pages = kv_pages[page_indices[seq]].reshape(n, m * page, combined, d)  # [N, S, 2Hkv, D']
    k, v = pages[:, :, 0::2], pages[:, :, 1::2]
    groups = q.reshape(n, hkv, h // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("nkgd,nskd->nkgs", groups, k.astype(jnp.float32)) * sm_scale
    visible = jnp.arange(m * page)[None, :] <= position[:, None]  # [N, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("nkgs,nskd->nkgd", weights, v.astype(jnp.float32)).reshape(n, h, d)
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


def kv_heads_split(kv_heads: int, tp: int, itemsize: int) -> bool:
    """Whether stored KV heads split over a tensor axis of ``tp`` (the cache's sharding and the
    kernel's shard_map decide alike): evenly, into per-device counts the kernel tiles."""
    return tp > 1 and kv_heads % tp == 0 and kernel_tiles(kv_heads // tp, itemsize)


def gpu_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The JAX-shipped GPU Pallas paged-attention kernel; q [B, T, H, D] -> [B, T, H, D]."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, t, h, d = q.shape
    rows, tables, lengths = _flatten_queries(q, block_tables, positions)
    per_block = _largest_divisor_at_most(tables.shape[1], 8)
    out = paged_attention(
        rows,
        k_pages,
        v_pages,
        tables,
        lengths,
        pages_per_compute_block=per_block,
        k_splits=1,
        interpret=interpret,
    )
    return out.reshape(b, t, h, d).astype(v_pages.dtype)


# Split-layout backends (the combined ones are called by the cache, see COMBINED).
BACKENDS: dict[str, AttentionFn] = {
    "cpu": reference_attention,
    "gpu": gpu_attention,
    "gpu_interpret": lambda *a: gpu_attention(*a, interpret=True),
}


def resolve_backend(name: str, platform: str | None = None) -> str:
    """``auto`` -> ``platform`` (default: the one JAX runs on) as cpu, gpu or tpu; other names
    are checked."""
    if name == "auto":
        platform = platform or jax.default_backend()
        platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
        return platform if platform in ("tpu", "gpu") else "cpu"
    if name not in BACKENDS and name not in COMBINED:
        choices = sorted([*BACKENDS, *COMBINED])
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices}")
    return name
