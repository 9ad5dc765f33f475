"""Mixed precision: the trainer's master weights and whether an update can move them.

The trainer keeps its trainable weights, the AdamW moments and the gradient accumulator in
``trainer.master_dtype`` (float32 by default) whatever ``model.param_dtype`` stores; the forward
and backward cast weights to ``model.compute_dtype`` where they are used (models/layers.py), so
a bf16-compute step reads exactly the bf16 values it would read from bf16 storage, and the
update lands in float32. This is how MaxText and other large JAX trainers do it.

Why: AdamW moves each weight by about the learning rate (its step is lr * m / sqrt(v)). A
bfloat16 weight w has 8 significant bits, so it changes under an update u only when |u| exceeds
half its spacing, 2^(floor(log2 |w|) - 8): for |w| = 0.01 that is 3e-5, and an lr of 1e-6
rounds to nothing. :func:`movable_fraction` counts the weights that an update of a given size
moves at a dtype; :func:`check_master_dtype` refuses bf16 masters where most would not move.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tpu.config import ConfigError

# Below this fraction of weights moved by one step of size lr, a bf16 master cannot learn.
MIN_MOVABLE_FRACTION = 0.5
_SIGNIFICAND_BITS = {jnp.dtype(jnp.bfloat16): 8, jnp.dtype(jnp.float32): 24}


def to_master(tree: Any, dtype: str | jnp.dtype) -> Any:
    """Every floating leaf of ``tree`` cast to ``dtype`` (jitted by the caller for sharded
    arrays; ShapeDtypeStructs are re-typed, their shardings kept)."""
    dtype = jnp.dtype(dtype)

    def one(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(one, tree)


def half_spacing(w: jax.Array, dtype: str | jnp.dtype) -> jax.Array:
    """Half the gap between ``w`` (as stored in ``dtype``) and its larger-magnitude neighbour:
    an update smaller than this rounds back to ``w`` (round to nearest). [same shape as w]"""
    bits = _SIGNIFICAND_BITS[jnp.dtype(dtype)]
    w = jnp.abs(w.astype(jnp.float32))
    _, exponent = jnp.frexp(w)  # |w| = m 2^e, m in [0.5, 1): spacing 2^(e - bits)
    return jnp.where(w > 0, jnp.ldexp(jnp.float32(1.0), exponent - 1 - bits), 0.0)


def movable_fraction(params: Any, step: float, dtype: str | jnp.dtype) -> float:
    """The fraction of all weights in ``params`` that an update of magnitude ``step`` changes
    when they are stored in ``dtype`` (zeros always move)."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return 1.0
    count = jax.jit(
        lambda xs: sum(jnp.sum(step > half_spacing(x, dtype), dtype=jnp.float32) for x in xs)
    )
    total = sum(int(np.prod(x.shape)) for x in leaves)
    return float(count(leaves)) / total


def check_master_dtype(params: Any, *, master_dtype: str, learning_rate: float) -> float:
    """Raises ConfigError when ``master_dtype`` would round most AdamW steps of size
    ``learning_rate`` to nothing for these weights; returns the fraction that do move."""
    moved = movable_fraction(params, learning_rate, master_dtype)
    if moved < MIN_MOVABLE_FRACTION:
        raise ConfigError(
            "trainer.master_dtype",
            f"an AdamW step of about "
            f"trainer.learning_rate = {learning_rate:g} changes only {moved:.1%} of these weights "
            f"(a {master_dtype} weight moves only by more than half its spacing, about |w| x "
            f"2^-{_SIGNIFICAND_BITS[jnp.dtype(master_dtype)]}), so training would leave the model "
            "as it is; use master_dtype 'float32' (model.param_dtype can stay bfloat16)",
            master_dtype,
        )
    return moved
