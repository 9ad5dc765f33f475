"""Attention math shared by every cache backend, and the KV-cache interface the model calls.

The model never touches cache memory itself: each attention layer hands its new keys/values and
its queries to a :class:`KVCache`, which stores them however it likes (dense rows here, pages in
the inference engine) and returns the attention output. The full-sequence forward uses
:class:`NoCache`, which attends within the given tokens only, so training and decoding run the
same layer code.

Conventions for every method below:
  * ``positions`` [B, T] int32 is the absolute position of each token in its sequence;
    a negative position marks a padding slot: it is not stored and its output is unspecified
    (finite).
  * a query at position p attends to every stored token of the same sequence (batch row) at
    position <= p, and to nothing else (causal by position).
  * scores and softmax are computed in f32 whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

_MASKED = float(jnp.finfo(jnp.float32).min)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, H, D] queries (already rotated).
      k, v: [B, S, Hkv, D] keys (rotated) and values; H must be a multiple of Hkv.
      mask: [B, T, S] bool, True where the query may attend to the key.
    Returns:
      [B, T, H, D] in v's dtype.
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / d**0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d)


def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """[B, T, S] bool: key position valid (>= 0) and <= the query position."""
    qp, kp = q_positions[:, :, None], k_positions[:, None, :]
    return (kp >= 0) & (kp <= qp)


class KVCache(Protocol):
    """What an attention layer needs from a KV cache. Implementations are jax pytrees, used
    functionally: :meth:`attend` returns a new cache and never mutates ``self``, so a cache can be
    passed through ``jax.jit`` (donate it to update in place).

    One model step processes a chunk of T tokens per sequence (T = 1 for decode, T > 1 for
    (chunked) prefill). The model calls ``attend`` once per layer, in layer order, with the
    static Python ``layer`` index. An implementation must, for batch row b:
      1. store ``k[b, t]``, ``v[b, t]`` as the entries of position ``positions[b, t]`` of
         sequence b in layer ``layer`` (skipping padding slots, positions < 0);
      2. return attention of ``q[b, t]`` over the stored entries of sequence b at positions
         <= ``positions[b, t]``, including those just stored (use
         :func:`dot_product_attention`'s semantics: GQA grouping, 1/sqrt(D) scale, f32 softmax).
    Entries of earlier steps must have been written in earlier calls (sequences are processed
    in position order). Which memory holds sequence b (a dense row, pages via a block table) is
    the implementation's business; the block tables etc. travel inside the pytree.
    """

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """q [B, T, H, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, H, D], new cache)."""
        ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoCache:
    """Attention within the given chunk only (the full-sequence forward); stores nothing.

    ``kernel``: "dense" (:func:`dot_product_attention`, any positions), or "splash" /
    "splash_interpret" (JAX's TPU splash kernel, natively / in interpret mode: rows laid out
    with their real tokens first at positions 0..n-1, see models/splash.py)."""

    kernel: str = dataclasses.field(default="dense", metadata=dict(static=True))
    stateless = True  # stores nothing, ignores the layer index (see transformer.LayerLoop)

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, NoCache]:
        del layer
        if self.kernel == "dense":
            return dot_product_attention(q, k, v, causal_mask(positions, positions)), self
        from rlax_tpu.models.splash import splash_attention

        return splash_attention(q, k, v, interpret=self.kernel == "splash_interpret"), self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Contiguous cache: row b of layer l holds sequence b's keys/values at index = position.

    k, v: [L, B, S, Hkv, D] with S the longest sequence the cache holds. Positions >= S are
    dropped (the caller sizes S). A slot reused by a new sequence needs no reset: a query at
    position p only reads indices <= p, all rewritten by the new sequence before it gets there.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
    ) -> DenseKVCache:
        shape = (num_layers, batch, max_len, kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, DenseKVCache]:
        b, s = k.shape[0], self.max_len
        index = jnp.where(positions >= 0, positions, s)  # out of range: dropped
        rows = jnp.arange(b)[:, None]
        k_layer = self.k[layer].at[rows, index].set(k.astype(self.k.dtype), mode="drop")
        v_layer = self.v[layer].at[rows, index].set(v.astype(self.v.dtype), mode="drop")
        stored = jnp.broadcast_to(jnp.arange(s, dtype=positions.dtype), (b, s))
        out = dot_product_attention(q, k_layer, v_layer, causal_mask(positions, stored))
        new = DenseKVCache(k=self.k.at[layer].set(k_layer), v=self.v.at[layer].set(v_layer))
        return out, new
