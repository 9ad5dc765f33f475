"""An independent reference for the engine's log-probs: the same model math through another
program (a dense cache, the prompt in one prefill call, the log-softmax in a program of its own).
It agrees with the engine to f32 round-off, not bitwise: the bitwise replay is
``models.replay_logprobs``, which runs the engine's own programs (see ``engine.py``)."""

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
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    cache: models.DenseKVCache,
) -> tuple[jax.Array, models.DenseKVCache]:
    logits, cache = models.step(nnx.merge(graphdef, state), tokens, positions, cache)
    return logits[0], cache


def replay_logits(
    model: models.Transformer, tokens: Sequence[int], *, prompt_len: int
) -> np.ndarray:
    """f32 logits [len(tokens) - prompt_len + 1, V] of the positions prompt_len - 1 on (entry t
    predicts tokens[prompt_len + t], the completion's token t): the prompt prefix in one
    ``models.step`` call on a one-row ``DenseKVCache``, then one token per call."""
    graphdef, state = nnx.split(model)
    cache = models.make_dense_cache(model.cfg, 1, len(tokens))
    first = prompt_len - 1
    out = []
    if first:
        prefix = jnp.asarray(tokens[:first], jnp.int32)[None]
        _, cache = _dense_step(
            graphdef, state, prefix, jnp.arange(first, dtype=jnp.int32)[None], cache
        )
    for p in range(first, len(tokens)):
        t = jnp.asarray([[tokens[p]]], jnp.int32)
        logits, cache = _dense_step(graphdef, state, t, jnp.asarray([[p]], jnp.int32), cache)
        out.append(np.asarray(logits[0]))
    return np.stack(out)


def temperature_scaled_logprobs(
    logits: np.ndarray, targets: Sequence[int], temperature: float
) -> np.ndarray:
    """[T] f32: log_softmax(logits / T)[target] per row (T = 1 when greedy), as the sampler."""
    t = 1.0 if temperature <= 0 else temperature
    z = jnp.asarray(logits, jnp.float32) / jnp.float32(t)
    lp = jax.nn.log_softmax(z, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(targets)[:, None], axis=-1)[:, 0])
