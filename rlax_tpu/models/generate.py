"""A minimal greedy decoder over the dense KV cache, for tests, demos and sanity checks.

The inference engine (paged cache, continuous batching, sampling) lives in ``rlax_tpu.inference``;
this is the simplest correct user of ``step``: prefill the prompt in one chunk, then decode one
token at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.models.attention import DenseKVCache
from rlax_tpu.models.transformer import Transformer, make_dense_cache, step


def check_token_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Raise ValueError if any id in ``tokens`` is outside [0, vocab_size)."""
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{what}: token id {int(tokens[where])} at index {where} is outside the vocabulary "
            f"[0, {vocab_size})"
        )


@partial(jax.jit, static_argnums=0, donate_argnums=4)
def _step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    cache: DenseKVCache,
):
    logits, cache = step(nnx.merge(graphdef, state), tokens, positions, cache)
    return logits[:, -1], cache


def greedy_generate(
    model: Transformer,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
) -> tuple[list[int], np.ndarray]:
    """Greedy continuation of one prompt.

    Returns the generated ids (ending with a stop id if one was produced) and the f32 logits
    [n, V] each of them was chosen from. Raises ValueError on an empty prompt, token ids outside
    the vocabulary or ``max_new_tokens`` < 1.
    """
    # Checked on the host: inside jit an out-of-range id gathers garbage (NaN logits).
    if not prompt:
        raise ValueError("greedy_generate: the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"greedy_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    check_token_ids(np.asarray(prompt), model.cfg.vocab_size, "greedy_generate: prompt")
    graphdef, state = nnx.split(model)
    cache = make_dense_cache(model.cfg, 1, len(prompt) + max_new_tokens)
    tokens = jnp.asarray([list(prompt)], jnp.int32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits, cache = _step(graphdef, state, tokens, positions, cache)
    out: list[int] = []
    all_logits = []
    for i in range(max_new_tokens):
        all_logits.append(np.asarray(logits[0]))
        out.append(int(jnp.argmax(logits[0])))
        if out[-1] in stop_ids or i == max_new_tokens - 1:
            break
        pos = jnp.full((1, 1), len(prompt) + i, jnp.int32)
        logits, cache = _step(graphdef, state, jnp.full((1, 1), out[-1], jnp.int32), pos, cache)
    return out, np.stack(all_logits)
