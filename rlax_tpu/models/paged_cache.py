"""The device half of the paged KV cache: a jax pytree implementing ``rlax_tpu.models.KVCache``.

``k_pages``/``v_pages`` [L, Hkv, P, page_size, D'] (D' = :func:`stored_head_dim`) hold every
layer's pages (zero-initialized, so masked reads stay finite); ``block_tables`` [B, M] say which
pages hold each batch row's sequence
(several rows may share one table: prompt chunks of one sequence in the prefill program). ``attend``
first writes the new keys/values of all rows, then lets the backend attend, so a query sees the
tokens written by other rows of the same step at earlier positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.paged_attention import BACKENDS, span_attention
from rlax_tpu.models.sharding import constrain, logical_sharding

# Logical axes of k_pages / v_pages [L, Hkv, P, page_size, D'].
PAGE_AXES = (None, "kv_heads", None, None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k_pages: jax.Array  # [L, Hkv, P, page_size, D]
    v_pages: jax.Array  # [L, Hkv, P, page_size, D]
    block_tables: jax.Array  # [B, M] int32
    backend: str = dataclasses.field(default="cpu", metadata=dict(static=True))
    # (rows, pages) per consecutive row group: the CPU backend attends group j's rows over their
    # tables' first pages_j pages only (see paged_attention.span_attention); () = all rows,
    # all pages. Static: each distinct tuple is its own program.
    spans: tuple[tuple[int, int], ...] = dataclasses.field(
        default=(), metadata=dict(static=True)
    )

    @classmethod
    def create(
        cls, cfg: ModelConfig, *, num_pages: int, page_size: int, batch: int,
        pages_per_seq: int, backend: str = "cpu",
    ) -> PagedKVCache:  # fmt: skip
        d = stored_head_dim(cfg, backend)
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, d)
        dtype = jnp.dtype(cfg.compute_dtype)
        return cls(
            k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
            block_tables=jnp.zeros((batch, pages_per_seq), jnp.int32), backend=backend,
        )  # fmt: skip

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    def with_tables(
        self, block_tables: jax.Array, spans: tuple[tuple[int, int], ...] = ()
    ) -> PagedKVCache:
        return dataclasses.replace(self, block_tables=block_tables, spans=spans)

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> PagedKVCache:
        """Copy-on-write: page src[i] -> dst[i] in every layer. src, dst [K] int32; pairs
        (0, 0) are padding (the null page onto itself)."""
        k = self.k_pages.at[:, :, dst].set(self.k_pages[:, :, src])
        v = self.v_pages.at[:, :, dst].set(self.v_pages[:, :, src])
        return dataclasses.replace(self, k_pages=k, v_pages=v)

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, PagedKVCache]:
        """q [B, T, H, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, H, D], new cache)."""
        page = self.page_size
        valid = positions >= 0
        safe = jnp.where(valid, positions, 0)
        table_index = jnp.minimum(safe // page, self.block_tables.shape[1] - 1)
        physical = jnp.take_along_axis(self.block_tables, table_index, axis=1)
        physical = jnp.where(valid & (safe // page < self.block_tables.shape[1]), physical,
                             self.num_pages)  # fmt: skip  # out of range: the write is dropped
        slot = safe % page
        pad = self.k_pages.shape[-1] - k.shape[-1]  # stored_head_dim
        if pad:
            k, v = (jnp.pad(x, ((0, 0),) * 3 + ((0, pad),)) for x in (k, v))
        # Advanced indices (layer, physical, slot) around a slice put their [B, T] dims first,
        # so the update is laid out like k: [B, T, Hkv, D].
        k_pages = self.k_pages.at[layer, :, physical, slot].set(
            k.astype(self.k_pages.dtype), mode="drop"
        )
        v_pages = self.v_pages.at[layer, :, physical, slot].set(
            v.astype(self.v_pages.dtype), mode="drop"
        )
        # Under a mesh the pages stay split over KV heads (a no-op on one device).
        k_pages, v_pages = constrain(k_pages, PAGE_AXES), constrain(v_pages, PAGE_AXES)
        if self.spans and self.backend == "cpu":
            out = span_attention(
                q, k_pages[layer], v_pages[layer], self.block_tables, positions, self.spans
            )
        else:
            out = BACKENDS[self.backend](
                q, k_pages[layer], v_pages[layer], self.block_tables, positions
            )
        return out, dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)


def stored_head_dim(cfg: ModelConfig, backend: str) -> int:
    """Head dim of the cache's pages: the model's, rounded up to the 128 lanes the TPU Pallas
    kernel's blocks need (its per-row max/sum outputs take the head dim's block), zero-padded,
    which changes no dot product."""
    d = cfg.resolved_head_dim
    return -(-d // 128) * 128 if backend in ("tpu", "tpu_interpret") else d


def page_bytes(cfg: ModelConfig, page_size: int, backend: str = "cpu") -> int:
    """Bytes of one page across all layers, keys and values."""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    d = stored_head_dim(cfg, backend)
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * d * itemsize


def cache_shardings(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """NamedShardings for ``cache`` on ``mesh``: pages split over KV heads on the tensor axis
    (replicated when the heads do not divide evenly, e.g. 2 KV heads on tensor 4: every device
    then holds every head's pages), block tables replicated."""
    pages = logical_sharding(PAGE_AXES, cache.k_pages.shape, mesh)
    tables = logical_sharding((None, None), cache.block_tables.shape, mesh)
    return dataclasses.replace(cache, k_pages=pages, v_pages=pages, block_tables=tables)
