"""The engine's numerics replayed with the dense cache: the recipe a trainer follows to reproduce
reported log-probs bitwise on CPU (see ``engine.py``'s docstring), and the tests' reference."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu import models


@partial(jax.jit, static_argnums=0, donate_argnums=4)
def _dense_step(
    graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, positions: jax.Array,
    cache: models.DenseKVCache,
) -> tuple[jax.Array, models.DenseKVCache]:  # fmt: skip
    logits, cache = models.step(nnx.merge(graphdef, state), tokens, positions, cache)
    return logits[:, 0], cache


def replay_logits(
    model: models.Transformer, tokens: Sequence[int], *, prompt_len: int,
    shape: models.ReplayShape, row: int = 0,
) -> np.ndarray:  # fmt: skip
    """f32 logits [len(tokens) - prompt_len + 1, V] of the positions prompt_len - 1 on (entry t
    predicts tokens[prompt_len + t], the completion's token t): the prompt prefix (all but its
    last token, when ``shape`` has a prefill program) through the prefill program
    (``models.scoring.prefill_prefixes``), then one token per ``models.step`` call in row ``row``
    of a [slots, 1] batch whose other rows are padding, against ``DenseKVCache(batch=slots,
    max_len=cache_len)``."""
    graphdef, state = nnx.split(model)
    cache = models.make_dense_cache(model.cfg, shape.slots, shape.cache_len)
    first = shape.prefix(prompt_len)
    if first:
        prefixes = [np.zeros(0, np.int32)] * row + [np.asarray(tokens[:first], np.int32)]
        cache = models.prefill_prefixes(model, prefixes, cache, shape=shape)
    out = []
    for p in range(first, len(tokens)):
        t = np.zeros((shape.slots, 1), np.int32)
        pos = np.full((shape.slots, 1), -1, np.int32)
        t[row, 0], pos[row, 0] = tokens[p], p
        logits, cache = _dense_step(graphdef, state, jnp.asarray(t), jnp.asarray(pos), cache)
        if p >= prompt_len - 1:
            out.append(np.asarray(logits[row]))
    return np.stack(out)


def temperature_scaled_logprobs(
    logits: np.ndarray, targets: Sequence[int], temperature: float
) -> np.ndarray:
    """[T] f32: log_softmax(logits / T)[target] per row (T = 1 when greedy), as the sampler."""
    t = 1.0 if temperature <= 0 else temperature
    z = jnp.asarray(logits, jnp.float32) / jnp.float32(t)
    lp = jax.nn.log_softmax(z, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(targets)[:, None], axis=-1)[:, 0])
