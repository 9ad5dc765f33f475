"""Grouped matmuls for the MoE experts: rows sorted by group, each group's rows times its own
matrix, and nothing computed for the rows past the last group.

Kernels (``model.expert_kernel``):

* ``ragged_dot``: ``jax.lax.ragged_dot``, XLA's. On TPU it computes every row it is given and,
  in its weight gradient, every group densely (``tests/aot/test_grouped_matmul_cost.py``): under
  expert parallelism D x the rows a device's experts received, and G x the weight gradient.
* ``megablox``: the Pallas TPU grouped matmul of ``jax.experimental.pallas.ops.tpu.megablox``
  (``gmm`` forward and for the rows' gradient, ``tgmm`` for the weights'). Its grid visits only
  the row tiles that hold a group's rows, so the work follows the rows routed, not the buffer.
  Its static cost estimate is still 2·M·K·N (the buffer), which is what an AOT report counts.
* ``megablox_interpret``: the same kernels in Pallas's interpreter: how the tests check them on
  CPU (slow; small shapes only).
* ``auto``: ``megablox`` when the program is traced for TPU devices (the mesh's, or JAX's
  default backend without one), ``ragged_dot`` elsewhere.

What the kernels leave in rows past the last group is not specified (the interpreter leaves
NaN): :func:`grouped_matmul` gives zeros there, in the output and in the rows' gradient.
"""

from __future__ import annotations

import importlib
from functools import partial

import jax
import jax.numpy as jnp

from rlax_tpu.config.model import EXPERT_KERNELS as KERNELS

# The kernels' module (the package's ``gmm`` attribute is its own custom-VJP function instead).
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

# Tile edges. Rows: 128 (a v5p MXU's edge) unless groups average 512 rows or more, when 512
# loads each weight tile a quarter as often; the contracted and output dims: at most 512, which
# with bf16 operands, f32 accumulation and double buffering is ~4 MiB of VMEM (TPU scoped VMEM
# defaults to 16 MiB or more). A dim of at most 512 is one tile of its full size, which Mosaic
# accepts at any size (a block equal to the array's dim); a longer one takes the largest
# multiple of 128 up to 512 that divides it (768: 384), so that no tile is partly masked.
_ROW_TILES = (128, 512)
_MAX_TILE = 512
_LANE = 128


def resolve_kernel(name: str) -> str:
    """``auto`` -> ``megablox`` on TPU devices (the current mesh's, else JAX's default backend),
    ``ragged_dot`` elsewhere; other names are checked."""
    if name not in KERNELS:
        raise ValueError(f"unknown expert kernel {name!r}; choose one of {list(KERNELS)}")
    if name != "auto":
        return name
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return "megablox" if platform == "tpu" else "ragged_dot"


def grouped_matmul(
    rows: jax.Array, weights: jax.Array, sizes: jax.Array, kernel: str = "ragged_dot"
) -> jax.Array:
    """rows [M, K] sorted by group, weights [G, K, N], sizes [G] int32 (sum <= M) -> [M, N] in
    rows' dtype: rows sizes[0]·· of group 0 times weights[0], and so on; zeros past the groups
    (``ragged_dot`` leaves them unspecified: its callers mask them)."""
    kernel = resolve_kernel(kernel)
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(rows, weights, sizes)
    return _megablox(rows, weights, sizes.astype(jnp.int32), kernel == "megablox_interpret")


def _tile(dim: int) -> int:
    if dim <= _MAX_TILE:
        return dim
    return next((t for t in range(_MAX_TILE, 0, -_LANE) if dim % t == 0), _MAX_TILE)


def _tiling(m: int, k: int, n: int, groups: int) -> tuple[int, int, int]:
    # Rows per group counts the rows past the groups too (another device's experts under
    # expert parallelism): an overestimate there, which only picks the larger row tile sooner.
    tm = _ROW_TILES[1] if m // max(groups, 1) >= _ROW_TILES[1] else _ROW_TILES[0]
    return tm, _tile(k), _tile(n)


def _valid(m: int, sizes: jax.Array) -> jax.Array:
    return (jnp.arange(m) < jnp.sum(sizes))[:, None]


def _padded(a: jax.Array, tm: int) -> jax.Array:
    return jnp.pad(a, ((0, -a.shape[0] % tm), (0, 0)))


def _gmm(
    rows: jax.Array, weights: jax.Array, sizes: jax.Array, interpret: bool, transpose: bool
) -> jax.Array:
    """[M, K] x [G, K, N] (``transpose``: [G, N, K]) -> [M, N], zeros past the groups."""
    m, k = rows.shape
    n = weights.shape[1] if transpose else weights.shape[2]
    tiling = _tiling(m, k, n, weights.shape[0])
    out = megablox.gmm(
        _padded(rows, tiling[0]),
        weights,
        sizes,
        rows.dtype,
        tiling,
        transpose_rhs=transpose,
        interpret=interpret,
    )[:m]
    return jnp.where(_valid(m, sizes), out, jnp.zeros_like(out))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _megablox(rows: jax.Array, weights: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    return _gmm(rows, weights, sizes, interpret, transpose=False)


def _megablox_fwd(rows, weights, sizes, interpret):  # noqa: ANN001, ANN202
    return _gmm(rows, weights, sizes, interpret, transpose=False), (rows, weights, sizes)


def _megablox_bwd(interpret, residual, grad):  # noqa: ANN001, ANN202
    rows, weights, sizes = residual
    m, k = rows.shape
    valid = _valid(m, sizes)
    grad = jnp.where(valid, grad, jnp.zeros_like(grad))  # the rows past the groups: no part
    d_rows = _gmm(grad, weights, sizes, interpret, transpose=True)
    tiling = _tiling(m, k, grad.shape[1], weights.shape[0])
    d_weights = megablox.tgmm(
        _padded(jnp.where(valid, rows, jnp.zeros_like(rows)), tiling[0]).T,
        _padded(grad, tiling[0]),
        sizes,
        weights.dtype,
        tiling,
        interpret=interpret,
    )
    return d_rows, d_weights, None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)
