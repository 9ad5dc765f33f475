"""Training attention through JAX's TPU splash-attention kernel (flash attention with a block-
sparse causal mask): the [L, L] scores are never materialized, so memory grows with L, not L².

:func:`splash_attention` computes what :func:`rlax_tpu.models.dot_product_attention` with a
causal mask computes, for sequences laid out as the trainer's batches are: each row's real tokens
first, at positions 0..n-1 (its column index), padding after them. A query then sees exactly the
keys at columns <= its own, so the kernel's causal-by-index mask is the causal-by-position mask
(padding keys come after every real query; padding queries' outputs are unspecified). The
sequence is zero-padded to the kernel's blocks and the head dim to 128 lanes (zeros change no
dot product; the softmax scale is the model's). GQA: the kernel's MQA form per KV head, vmapped
over KV heads and rows. Under a mesh it runs in shard_map (rows over the batch axes, heads over
tensor where they divide), as Mosaic kernels are not partitioned automatically.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rlax_tpu.models.sharding import kernel_axes

_LANES = 128
_MAX_BLOCK = 512


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D] in v's dtype (see the module doc)."""
    call = functools.partial(_rows, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        rows, heads = kernel_axes(mesh, q.shape[0], q.shape[2], k.shape[2])
        spec = P(rows, None, heads, None)
        call = jax.shard_map(
            call, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
        )
    return call(q, k, v)


def _rows(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool) -> jax.Array:
    b, length, h, d = q.shape
    hkv = k.shape[2]
    block = min(_MAX_BLOCK, -(-length // _LANES) * _LANES)
    padded = -(-length // block) * block
    dp = -(-d // _LANES) * _LANES
    kernel = _kernel(padded, h // hkv, block, interpret)
    pad = ((0, 0), (0, padded - length), (0, 0), (0, dp - d))
    scale = 1.0 / math.sqrt(d)
    qs = jnp.pad((q.astype(jnp.float32) * scale).astype(q.dtype), pad)
    ks, vs = jnp.pad(k, pad), jnp.pad(v, pad)
    # [B, L, H, D] -> [B, Hkv, G, L, D] for q, [B, Hkv, L, D] for k and v.
    qg = qs.reshape(b, padded, hkv, h // hkv, dp).transpose(0, 2, 3, 1, 4)
    kg, vg = ks.transpose(0, 2, 1, 3), vs.transpose(0, 2, 1, 3)
    out = jax.vmap(jax.vmap(kernel))(qg, kg, vg)  # [B, Hkv, G, L, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, dp)
    return out[:, :length, :, :d].astype(v.dtype)


def _kernel(length: int, group: int, block: int, interpret: bool):  # noqa: ANN202
    """The MQA splash kernel for ``group`` q heads per KV head over ``length`` tokens."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((length, length))] * group)
    sizes = kernel_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # Built in the trace that calls it (its mask tables are arrays of that trace; a kernel kept
    # across traces would leak them): a few numpy block tables per layer, at trace time only.
    return kernel_lib.make_splash_mqa_single_device(
        mask=mask, block_sizes=sizes, interpret=interpret
    )
