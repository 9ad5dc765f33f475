"""The device half of the paged KV cache: a jax pytree implementing ``rlax_tpu.models.KVCache``.

Two layouts of every layer's pages (D' = :func:`stored_head_dim`; zero-initialized, so masked
reads stay finite), each the one its backend's kernel reads without a copy:

* split (cpu, gpu): ``k_pages``, ``v_pages`` [L, Hkv, P, page_size, D'];
* combined (tpu, tpu_emulated): ``kv_pages`` [L, P, page_size, 2 * Hs, D'], the keys of KV head h
  at 2h and its values at 2h + 1 (JAX's TPU ragged paged-attention kernel), Hs the model's KV
  heads padded with zero heads to a count the kernel tiles (:func:`stored_kv_heads`).

``block_tables`` [B, M] say which pages hold each batch row's sequence (several rows may share one
table: prompt chunks of one sequence in the prefill program). ``attend`` first writes the new
keys/values of all rows, then lets the backend attend, so a query sees the tokens written by other
rows of the same step at earlier positions.

Data shards (``shards`` = D > 1, the engine on a mesh with data = D): the page axis and the rows
are each cut into D contiguous blocks over the mesh's data axis; the rows of block s read and
write only the pages of block s, by page ids local to it (0 = its own null page). Writes and
attention then run per shard (``jax.shard_map`` manual over data only), so no device gathers
another shard's pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ModelConfig
from rlax_tpu.models import native_attention
from rlax_tpu.models.paged_attention import (
    BACKENDS,
    COMBINED,
    block_attention,
    kv_heads_split,
    padded_kv_heads,
    ragged_attention,
    span_attention,
)
from rlax_tpu.models.sharding import LOGICAL_AXIS_RULES, logical_to_spec

# Logical axes of k_pages / v_pages [L, Hkv, P, page_size, D'] and of kv_pages
# [L, P, page_size, 2 * Hkv, D'].
PAGE_AXES = (None, "kv_heads", None, None, None)
COMBINED_PAGE_AXES = (None, None, None, "kv_heads", None)
_DATA = "data"  # the mesh axis data shards split pages and rows over (sharding.MESH_AXES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k_pages: jax.Array | None  # [L, Hkv, P, page_size, D'] (split layout)
    v_pages: jax.Array | None  # [L, Hkv, P, page_size, D'] (split layout)
    kv_pages: jax.Array | None  # [L, P, page_size, 2 * Hkv, D'] (combined layout)
    block_tables: jax.Array  # [B, M] int32
    backend: str = dataclasses.field(default="cpu", metadata=dict(static=True))
    # (rows, pages) per consecutive row group: the CPU backend attends group j's rows over their
    # tables' first pages_j pages only (see paged_attention.span_attention); () = all rows,
    # all pages. Static: each distinct tuple is its own program.
    spans: tuple[tuple[int, int], ...] = dataclasses.field(default=(), metadata=dict(static=True))
    # CPU backend, decode rows (T = 1): attend block by block over block_pages pages with an
    # online softmax, up to the step's furthest position (paged_attention.block_attention).
    # 0: every row over the whole cache. Static.
    block_pages: int = dataclasses.field(default=0, metadata=dict(static=True))
    # CPU backend, decode rows (T = 1), one device: the native kernel writes and attends
    # (native_attention.decode_attention); block_pages then serves no row. Static.
    native: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Data shards (module docstring): pages and rows in this many blocks over the data axis,
    # block tables holding ids local to a block. 1: one pool, global ids. Static.
    shards: int = dataclasses.field(default=1, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        batch: int,
        pages_per_seq: int,
        backend: str = "cpu",
        block_pages: int = 0,
        native: bool = False,
        shards: int = 1,
    ) -> PagedKVCache:
        """``num_pages`` and ``batch`` must divide by ``shards``."""
        if num_pages % shards or batch % shards:
            raise ValueError(
                f"{num_pages} pages and {batch} rows must divide by the {shards} data shards"
            )
        d = stored_head_dim(cfg, backend)
        dtype = jnp.dtype(cfg.compute_dtype)
        tables = jnp.zeros((batch, pages_per_seq), jnp.int32)
        if backend in COMBINED:
            shape = (cfg.num_layers, num_pages, page_size, 2 * stored_kv_heads(cfg, backend), d)
            return cls(
                k_pages=None,
                v_pages=None,
                kv_pages=jnp.zeros(shape, dtype),
                block_tables=tables,
                backend=backend,
                shards=shards,
            )
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, d)
        return cls(
            k_pages=jnp.zeros(shape, dtype),
            v_pages=jnp.zeros(shape, dtype),
            kv_pages=None,
            block_tables=tables,
            backend=backend,
            block_pages=block_pages,
            native=native,
            shards=shards,
        )

    @property
    def combined(self) -> bool:
        return self.kv_pages is not None

    @property
    def page_size(self) -> int:
        return self.kv_pages.shape[2] if self.combined else self.k_pages.shape[3]

    @property
    def num_pages(self) -> int:
        return self.kv_pages.shape[1] if self.combined else self.k_pages.shape[2]

    def read_pages(self, pages: jax.Array) -> list[jax.Array]:
        """Every layer's contents of physical ``pages`` [K] (keys and values, in this layout)."""
        if self.combined:
            return [self.kv_pages[:, pages]]
        return [self.k_pages[:, :, pages], self.v_pages[:, :, pages]]

    def with_tables(
        self, block_tables: jax.Array, spans: tuple[tuple[int, int], ...] = ()
    ) -> PagedKVCache:
        return dataclasses.replace(self, block_tables=block_tables, spans=spans)

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> PagedKVCache:
        """Copy-on-write: page src[i] -> dst[i] in every layer. src, dst [K] int32; pairs
        (0, 0) are padding (the null page onto itself). With data shards the ids are
        s * (num_pages / D) + a page id local to shard s, and each shard copies its own pairs."""
        if self.shards > 1:
            return self._per_shard(_copy_local, (src, dst), (P(), P()))
        if self.combined:
            kv = self.kv_pages.at[:, dst].set(self.kv_pages[:, src])
            return dataclasses.replace(self, kv_pages=kv)
        k = self.k_pages.at[:, :, dst].set(self.k_pages[:, :, src])
        v = self.v_pages.at[:, :, dst].set(self.v_pages[:, :, src])
        return dataclasses.replace(self, k_pages=k, v_pages=v)

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, PagedKVCache]:
        """q [B, T, H, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, H, D], new cache)."""
        if self.shards > 1:
            rows = P(_DATA)
            return self._per_shard(
                partial(_attend_local, layer), (q, k, v, positions), (rows,) * 4, rows
            )
        # The native kernel computes its own write slots (only split-layout caches have native).
        if self.native and q.shape[1] == 1 and not self.spans and one_device():
            out, k_pages, v_pages = native_attention.decode_attention(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                self.k_pages,
                self.v_pages,
                self.block_tables,
                positions[:, 0],
                layer=layer,
            )
            out = out[:, None].astype(q.dtype)
            return out, dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)
        page = self.page_size
        valid = positions >= 0
        safe = jnp.where(valid, positions, 0)
        table_index = jnp.minimum(safe // page, self.block_tables.shape[1] - 1)
        physical = jnp.take_along_axis(self.block_tables, table_index, axis=1)
        physical = jnp.where(
            valid & (safe // page < self.block_tables.shape[1]), physical, self.num_pages
        )  # out of range: the write is dropped
        slot = safe % page
        pad = self.page_dim - k.shape[-1]  # stored_head_dim
        if pad:
            k, v = (jnp.pad(x, ((0, 0),) * 3 + ((0, pad),)) for x in (k, v))
        if self.combined:
            return self._attend_combined(layer, q, k, v, positions, physical, slot)
        # Advanced indices (layer, physical, slot) around a slice put their [B, T] dims first,
        # so the update is laid out like k: [B, T, Hkv, D].
        k_pages = self.k_pages.at[layer, :, physical, slot].set(
            k.astype(self.k_pages.dtype), mode="drop"
        )
        v_pages = self.v_pages.at[layer, :, physical, slot].set(
            v.astype(self.v_pages.dtype), mode="drop"
        )
        # Under a mesh the pages stay split over KV heads (a no-op on one device).
        k_pages, v_pages = _constrain_pages(k_pages, self), _constrain_pages(v_pages, self)
        if self.spans and self.backend == "cpu":
            out = span_attention(
                q, k_pages[layer], v_pages[layer], self.block_tables, positions, self.spans
            )
        elif self.block_pages and self.backend == "cpu" and q.shape[1] == 1:
            out = block_attention(
                q,
                k_pages[layer],
                v_pages[layer],
                self.block_tables,
                positions,
                block_pages=self.block_pages,
            )
        else:
            out = BACKENDS[self.backend](
                q, k_pages[layer], v_pages[layer], self.block_tables, positions
            )
        return out, dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)

    def _attend_combined(
        self,
        layer: int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        physical: jax.Array,
        slot: jax.Array,
    ) -> tuple[jax.Array, PagedKVCache]:
        hkv = k.shape[2]
        kv = interleave_kv(k, v, stored_heads=self.kv_pages.shape[3] // 2)
        kv_pages = self.kv_pages.at[layer, physical, slot].set(
            kv.astype(self.kv_pages.dtype), mode="drop"
        )
        kv_pages = _constrain_pages(kv_pages, self)
        emulated = self.backend == "tpu_emulated"
        out = ragged_attention(
            q, kv_pages[layer], self.block_tables, positions, kv_heads=hkv, emulated=emulated
        )
        return out, dataclasses.replace(self, kv_pages=kv_pages)

    @property
    def page_dim(self) -> int:
        """The stored head dim (D')."""
        return (self.kv_pages if self.combined else self.k_pages).shape[-1]

    def _per_shard(self, fn: Callable, args: tuple, specs: tuple, out_spec: P | None = None) -> Any:
        """``fn(local cache, *args)`` on each data shard (manual over the data axis only: the
        tensor split of the KV heads stays XLA's): the local cache holds the shard's pages and
        block-table rows with ``shards = 1``. ``fn`` returns (out, cache) when ``out_spec`` is
        given (out split by it), else the cache."""
        mesh = jax.sharding.get_abstract_mesh()
        data = 1 if mesh.empty else mesh.shape.get(_DATA, 1)
        if data != self.shards:
            raise ValueError(
                f"a cache of {self.shards} data shards needs a mesh with data = {self.shards}, "
                f"not {data}"
            )
        pages = [None if x is None else _shard_spec(x.ndim, self.combined) for x in self._pages]
        cache_spec = dataclasses.replace(
            self, k_pages=pages[0], v_pages=pages[1], kv_pages=pages[2], block_tables=P(_DATA)
        )

        def local(cache: PagedKVCache, *xs: jax.Array) -> Any:
            result = fn(dataclasses.replace(cache, shards=1), *xs)
            if out_spec is None:
                return dataclasses.replace(result, shards=self.shards)
            out, written = result
            return out, dataclasses.replace(written, shards=self.shards)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(cache_spec, *specs),
            out_specs=cache_spec if out_spec is None else (out_spec, cache_spec),
            axis_names={_DATA},
            check_vma=False,
        )(self, *args)

    @property
    def _pages(self) -> tuple[jax.Array | None, ...]:
        return self.k_pages, self.v_pages, self.kv_pages


def _attend_local(
    layer: int, cache: PagedKVCache, q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array
) -> tuple[jax.Array, PagedKVCache]:
    return cache.attend(layer, q, k, v, pos)


def _copy_local(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """One shard's pairs of (src, dst) [K] (ids of every shard, see copy_pages): the others'
    become a dropped write."""
    n = cache.num_pages
    first = (jax.lax.axis_index(_DATA) * n).astype(src.dtype)
    src, dst = src - first, dst - first
    mine = (dst >= 0) & (dst < n)
    src, dst = jnp.where(mine, src, 0), jnp.where(mine, dst, n)
    if cache.combined:
        kv = cache.kv_pages.at[:, dst].set(cache.kv_pages[:, src], mode="drop")
        return dataclasses.replace(cache, kv_pages=kv)
    k = cache.k_pages.at[:, :, dst].set(cache.k_pages[:, :, src], mode="drop")
    v = cache.v_pages.at[:, :, dst].set(cache.v_pages[:, :, src], mode="drop")
    return dataclasses.replace(cache, k_pages=k, v_pages=v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequencePagedCache:
    """Whole sequences through the engine's paged attention, storing nothing: the π_old
    recompute as one prefill-shaped pass (RLAX §5.1). Each layer's keys/values of the chunk
    [B, T] are laid out as pages of ``page_size`` in ``backend``'s layout, row b in pages
    b*M .. b*M + M - 1 (M = ceil(T / page_size); a reshape, no scatter and no null page, so
    pages split over the batch axes with their rows), and the backend's attention (the TPU
    ragged kernel, the GPU Pallas kernel, the CPU reference) attends over them as the engine's
    prefill and decode rows do. Column j of a row is stored at slot j: rows must hold their
    real tokens first, at positions 0..n-1 (as the trainer's micro-batches lay them out).
    Stateless, so layers can be scanned and one layer's pages live at a time."""

    page_size: int = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(default="cpu", metadata=dict(static=True))
    stateless = True

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, SequencePagedCache]:
        """q [B, T, H, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, H, D], self)."""
        del layer
        b, t, hkv, d = k.shape
        page = self.page_size
        m = -(-t // page)
        tables = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
        if self.backend in COMBINED:
            k, v = (
                jnp.pad(x, ((0, 0), (0, m * page - t), (0, 0), (0, lane_padded(d) - d)))
                for x in (k, v)
            )
            stored = padded_kv_heads(hkv, k.dtype.itemsize)
            kv = interleave_kv(k, v, stored_heads=stored).reshape(b * m, page, 2 * stored, -1)
            emulated = self.backend == "tpu_emulated"
            out = ragged_attention(
                q, kv, tables, positions, kv_heads=hkv, emulated=emulated, pages_by_rows=True
            )
            return out, self
        k, v = (
            jnp.pad(x, ((0, 0), (0, m * page - t), (0, 0), (0, 0)))
            .reshape(b * m, page, hkv, d)
            .transpose(2, 0, 1, 3)
            for x in (k, v)
        )
        return BACKENDS[self.backend](q, k, v, tables, positions), self


def one_device() -> bool:
    """No mesh, or a mesh of one device: where a custom call needs no partitioning."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def _page_spec(
    shape: tuple[int, ...], combined: bool, mesh, itemsize: int, shards: int = 1
) -> jax.sharding.PartitionSpec:  # noqa: ANN001
    """Pages split over KV heads on the tensor axis, when the KV heads divide by it, and over
    the data axis by page with data shards. Combined pages are judged by their stored KV heads
    (not 2 *): a split keeps a head's keys and values on one device, and must leave each device
    a head count the TPU kernel tiles."""
    if not combined:
        spec = logical_to_spec(PAGE_AXES, shape, mesh)
    else:
        tensor = LOGICAL_AXIS_RULES["kv_heads"]
        tp = mesh.shape[tensor] if tensor in mesh.axis_names else 1
        split = kv_heads_split(shape[3] // 2, tp, itemsize)
        spec = logical_to_spec(COMBINED_PAGE_AXES, shape, mesh) if split else PartitionSpec()
    if shards == 1:
        return spec
    axes = [*spec, *(None,) * (len(shape) - len(spec))]
    axes[_page_axis(combined)] = _DATA
    return PartitionSpec(*axes)


def _page_axis(combined: bool) -> int:
    """The page axis of [L, P, ...] (combined) or [L, Hkv, P, ...] pages."""
    return 1 if combined else 2


def _shard_spec(ndim: int, combined: bool) -> PartitionSpec:
    """Pages by data shard, for shard_map (the manual data axis only)."""
    axes: list[str | None] = [None] * ndim
    axes[_page_axis(combined)] = _DATA
    return PartitionSpec(*axes)


def _constrain_pages(pages: jax.Array, cache: PagedKVCache) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return pages
    spec = _page_spec(pages.shape, cache.combined, mesh, pages.dtype.itemsize)
    return jax.lax.with_sharding_constraint(pages, spec)


def lane_padded(d: int) -> int:
    """A head dim rounded up to the TPU's 128 lanes."""
    return -(-d // 128) * 128


def interleave_kv(k: jax.Array, v: jax.Array, *, stored_heads: int) -> jax.Array:
    """k, v [B, T, Hkv, D] -> the combined layout's [B, T, 2 * Hs, D]: KV heads padded with zero
    heads to ``stored_heads`` (padded_kv_heads), the keys of head h at 2h, its values at 2h + 1."""
    b, t, hkv, d = k.shape
    k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, stored_heads - hkv), (0, 0))) for x in (k, v))
    return jnp.stack([k, v], axis=3).reshape(b, t, 2 * stored_heads, d)


def stored_head_dim(cfg: ModelConfig, backend: str) -> int:
    """Head dim of the cache's pages: the model's, rounded up to the 128 lanes the TPU Pallas
    kernel's blocks need (its per-row max/sum outputs take the head dim's block), zero-padded,
    which changes no dot product."""
    d = cfg.resolved_head_dim
    return lane_padded(d) if backend in COMBINED else d


def stored_kv_heads(cfg: ModelConfig, backend: str) -> int:
    """KV heads of the cache's pages: the model's, padded for the TPU kernel's tiling in the
    combined layout (zero heads: no query attends them)."""
    if backend in COMBINED:
        return padded_kv_heads(cfg.num_kv_heads, jnp.dtype(cfg.compute_dtype).itemsize)
    return cfg.num_kv_heads


def page_bytes(cfg: ModelConfig, page_size: int, backend: str = "cpu") -> int:
    """Bytes of one page across all layers, keys and values."""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    d = stored_head_dim(cfg, backend)
    return 2 * cfg.num_layers * stored_kv_heads(cfg, backend) * page_size * d * itemsize


def cache_shardings(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """NamedShardings for ``cache`` on ``mesh``: pages split over KV heads on the tensor axis
    (replicated when the heads do not divide evenly, e.g. 2 KV heads on tensor 4: every device
    then holds every head's pages) and, with data shards, by page over the data axis; block
    tables replicated, or by row over data with data shards."""
    shards = cache.shards
    pages = [
        None
        if x is None
        else NamedSharding(
            mesh, _page_spec(x.shape, cache.combined, mesh, x.dtype.itemsize, shards)
        )
        for x in (cache.k_pages, cache.v_pages, cache.kv_pages)
    ]
    tables = NamedSharding(mesh, P(_DATA if shards > 1 else None, None))
    return dataclasses.replace(
        cache, k_pages=pages[0], v_pages=pages[1], kv_pages=pages[2], block_tables=tables
    )
