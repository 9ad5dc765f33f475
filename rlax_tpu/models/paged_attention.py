"""Paged attention, one implementation per backend, all reading the same page layout.

Layout (per layer): ``k_pages``, ``v_pages`` [Hkv, P, page_size, D], the layout of the Pallas
paged-attention kernels that ship with JAX (TPU ``paged_attention`` and GPU ``paged_attention``),
so no backend transposes the cache. ``block_tables`` [B, M] int32 maps a sequence's page index to
a physical page (null page 0 past its end). Every backend computes, for query (b, t) at
``positions[b, t]`` = p >= 0, attention over positions 0..p of sequence b (the caller has already
written them); rows with p < 0 are padding and give finite, unspecified outputs.

* ``cpu``: gathers the block table's pages into a [B, S, Hkv, D] view (S = M * page_size) and runs
  :func:`rlax_tpu.models.dot_product_attention` with the causal mask by position. S and the math
  are those of ``DenseKVCache`` with ``max_len = S``: run op by op, its output is bitwise the
  dense cache's; inside a larger jitted program XLA may fuse the gather, so only to round-off.
  This is the reference and the CPU production path.
* ``tpu``: ``jax.experimental.pallas.ops.tpu.paged_attention`` (one query per row; every query
  token is treated as a row of length p + 1). Its blocks need a head dim that is a multiple of
  128, so the cache stores pages zero-padded to it (``paged_cache.stored_head_dim``) and the
  queries are padded per call; the padding adds 0 to every score and output lane.
* ``gpu``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (same flattening).
The ``*_interpret`` variants run the Pallas kernels in interpret mode, which is how the tests
check them on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlax_tpu.models.attention import causal_mask, dot_product_attention

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[Hkv, P, page, D] pages, [B, M] tables -> [B, M * page, Hkv, D] in position order."""
    hkv, _, page, d = pages.shape
    b, m = block_tables.shape
    gathered = pages[:, block_tables]  # [Hkv, B, M, page, D]
    return gathered.transpose(1, 2, 3, 0, 4).reshape(b, m * page, hkv, d)


def reference_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
    positions: jax.Array,
) -> jax.Array:  # fmt: skip
    """q [B, T, H, D] -> [B, T, H, D] (see the module docstring)."""
    k = gather_pages(k_pages, block_tables)
    v = gather_pages(v_pages, block_tables)
    stored = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=positions.dtype), k.shape[:2])
    return dot_product_attention(q, k, v, causal_mask(positions, stored))


def span_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
    positions: jax.Array, spans: tuple[tuple[int, int], ...],
) -> jax.Array:  # fmt: skip
    """:func:`reference_attention` by consecutive row groups: ``spans`` = ((rows, pages), ...),
    rows summing to B; group j attends over its tables' first pages_j pages (its rows' positions
    must be < pages_j * page_size). :func:`reference_attention`'s output to f32 round-off: the
    dropped positions are masked there, but a shorter sum may be blocked in another order
    (``tests/models/test_paged_attention.py`` checks it)."""
    outs, start = [], 0
    for rows, pages in spans:
        stop = start + rows
        outs.append(reference_attention(
            q[start:stop], k_pages, v_pages, block_tables[start:stop, :pages],
            positions[start:stop],
        ))  # fmt: skip
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


def tpu_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
    positions: jax.Array, *, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """The JAX-shipped TPU Pallas paged-attention kernel; q [B, T, H, D] -> [B, T, H, D]."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.tpu import force_tpu_interpret_mode

    b, t, h, d = q.shape
    rows, tables, lengths = _flatten_queries(q, block_tables, positions)
    per_block = _largest_divisor_at_most(tables.shape[1], 8)
    pad = k_pages.shape[-1] - d  # pages stored with a lane-padded head dim (stored_head_dim)
    if pad:
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, pad)))

    def call(rows, k_pages, v_pages, lengths, tables):  # noqa: ANN001, ANN202
        return paged_attention(
            rows, k_pages, v_pages, lengths, tables, pages_per_compute_block=per_block
        )

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        # Mosaic kernels are not partitioned automatically: each device runs the kernel on its
        # rows (batch axes) and its heads (tensor axis), or on everything where they don't split.
        call = _sharded_kernel(call, mesh, rows.shape[0], h, k_pages.shape[0])
    args = (rows, k_pages, v_pages, lengths, tables)
    if interpret:
        with force_tpu_interpret_mode():
            out = call(*args)
    else:
        out = call(*args)
    return out[..., :d].reshape(b, t, h, d).astype(v_pages.dtype)


def _sharded_kernel(call: Callable, mesh: jax.sharding.AbstractMesh, rows: int, heads: int,
                    kv_heads: int) -> Callable:  # fmt: skip
    """``call(rows [N, H, D], k/v pages [Hkv, ...], lengths [N], tables [N, M])`` under
    ``jax.shard_map``: rows split over the batch axes and heads over the tensor axis when they
    divide evenly (q heads and KV heads together, so each device keeps whole GQA groups)."""
    from jax.sharding import PartitionSpec as P

    from rlax_tpu.models.sharding import LOGICAL_AXIS_RULES

    names = mesh.axis_names
    batch = tuple(a for a in LOGICAL_AXIS_RULES["batch"] if a in names and mesh.shape[a] > 1)
    shards = 1
    for a in batch:
        shards *= mesh.shape[a]
    rows_axis = (batch if len(batch) > 1 else batch[0]) if batch and rows % shards == 0 else None
    tensor = LOGICAL_AXIS_RULES["heads"]
    tp = mesh.shape[tensor] if tensor in names else 1
    head_axis = tensor if tp > 1 and heads % tp == 0 and kv_heads % tp == 0 else None
    return jax.shard_map(
        call, mesh=mesh,
        in_specs=(P(rows_axis, head_axis, None), P(head_axis), P(head_axis), P(rows_axis),
                  P(rows_axis, None)),
        out_specs=P(rows_axis, head_axis, None), check_vma=False,
    )  # fmt: skip


def gpu_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
    positions: jax.Array, *, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """The JAX-shipped GPU Pallas paged-attention kernel; q [B, T, H, D] -> [B, T, H, D]."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, t, h, d = q.shape
    rows, tables, lengths = _flatten_queries(q, block_tables, positions)
    per_block = _largest_divisor_at_most(tables.shape[1], 8)
    out = paged_attention(
        rows, k_pages, v_pages, tables, lengths, pages_per_compute_block=per_block, k_splits=1,
        interpret=interpret,
    )  # fmt: skip
    return out.reshape(b, t, h, d).astype(v_pages.dtype)


BACKENDS: dict[str, AttentionFn] = {
    "cpu": reference_attention,
    "tpu": tpu_attention,
    "gpu": gpu_attention,
    "tpu_interpret": lambda *a: tpu_attention(*a, interpret=True),
    "gpu_interpret": lambda *a: gpu_attention(*a, interpret=True),
}


def resolve_backend(name: str, platform: str | None = None) -> str:
    """``auto`` -> ``platform`` (default: the one JAX runs on) as cpu, gpu or tpu; other names
    are checked."""
    if name == "auto":
        platform = platform or jax.default_backend()
        platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
        return platform if platform in ("tpu", "gpu") else "cpu"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return name
