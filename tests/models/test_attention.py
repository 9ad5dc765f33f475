"""The KVCache protocol: grouped-query attention against a per-head reference, and a toy paged
cache (block tables, shuffled physical pages) that plugs into ``step`` unchanged, which is
what the inference engine's paged cache does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.models.attention import causal_mask, dot_product_attention
from rlax_tpu.models.presets import preset
from rlax_tpu.models.transformer import forward, init_model, step


def test_gqa_matches_per_head_softmax_reference():
    rng = np.random.default_rng(0)
    b, t, s, h, hkv, d = 2, 3, 5, 4, 2, 8
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.7
    mask[..., 0] = True
    out = np.asarray(dot_product_attention(q, k, v, jnp.asarray(mask)))
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                kv = hi // (h // hkv)  # query head hi reads KV head hi // group
                scores = k[bi, :, kv] @ q[bi, ti, hi] / np.sqrt(d)
                scores = np.where(mask[bi, ti], scores, -np.inf)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                np.testing.assert_allclose(out[bi, ti, hi], p @ v[bi, :, kv], atol=1e-5)


def test_causal_mask_by_position():
    q = jnp.asarray([[2, -1]])
    k = jnp.asarray([[0, 1, 2, 3, -1]])
    np.testing.assert_array_equal(
        np.asarray(causal_mask(q, k))[0], [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyPagedCache:
    """k/v pages [L, num_pages, page, Hkv, D]; block_table [B, blocks]: page ids per sequence."""

    k: jax.Array
    v: jax.Array
    block_table: jax.Array

    def attend(self, layer, q, k, v, positions):
        page = self.k.shape[2]
        b, blocks = self.block_table.shape
        phys = jnp.take_along_axis(self.block_table, jnp.maximum(positions, 0) // page, axis=1)
        flat = phys * page + positions % page
        flat = jnp.where(positions >= 0, flat, self.k.shape[1] * page)  # padding: dropped
        shape = (-1, *self.k.shape[3:])
        k_layer = self.k[layer].reshape(shape).at[flat].set(k, mode="drop")
        v_layer = self.v[layer].reshape(shape).at[flat].set(v, mode="drop")
        k_pages = k_layer.reshape(self.k.shape[1:])
        v_pages = v_layer.reshape(self.v.shape[1:])
        seq_k = k_pages[self.block_table].reshape(b, blocks * page, *shape[1:])
        seq_v = v_pages[self.block_table].reshape(b, blocks * page, *shape[1:])
        stored = jnp.broadcast_to(jnp.arange(blocks * page), (b, blocks * page))
        out = dot_product_attention(q, seq_k, seq_v, causal_mask(positions, stored))
        return out, dataclasses.replace(
            self,
            k=self.k.at[layer].set(k_pages),
            v=self.v.at[layer].set(v_pages),
        )


def test_a_paged_cache_plugs_into_step():
    cfg = preset("tiny")
    model = init_model(cfg, seed=4)
    tokens = jax.random.randint(jax.random.key(5), (2, 11), 0, cfg.vocab_size, jnp.int32)
    full = np.asarray(nnx.jit(forward)(model, tokens))

    page, blocks, num_pages = 4, 3, 8
    table = np.random.default_rng(1).permutation(num_pages)[: 2 * blocks].reshape(2, blocks)
    shape = (cfg.num_layers, num_pages, page, cfg.num_kv_heads, cfg.resolved_head_dim)
    cache = ToyPagedCache(jnp.zeros(shape), jnp.zeros(shape), jnp.asarray(table, jnp.int32))
    jstep = nnx.jit(step)
    pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    logits, cache = jstep(model, tokens[:, :6], pos[:, :6], cache)  # prefill spans 2 pages
    pieces = [np.asarray(logits)]
    for t in range(6, 11):  # decode across a page boundary
        logits, cache = jstep(model, tokens[:, t : t + 1], pos[:, t : t + 1], cache)
        pieces.append(np.asarray(logits))
    assert np.abs(np.concatenate(pieces, axis=1) - full).max() <= 1e-5
