"""Scoring given tokens the way the inference engine scored them when it sampled them.

``sampled_logprobs``  the per-token log-prob the engine reports: log-softmax of the f32
                      decode-time logits divided by the temperature, at the sampled token.
``replay_logprobs``   re-runs the engine's computation for whole rollouts (RLAX §5: the old-policy
                      recompute runs the inference graph) against a ``DenseKVCache`` of
                      ``cache_len`` positions: the prompt prefix (all but the last prompt token)
                      through the prefill program, [prefill_rows, prefill_len] chunks at fixed
                      boundaries (keys/values only), then every later token through ``step`` as
                      one row of a [slots, 1] batch, each under its own ``jax.jit``, as the
                      engine runs them. ``prefill_rows = 0``: every token as a row.
``prefill_prefixes``  that prefill program alone (the engine's replay reference uses it too).

Why this reproduces the engine bit for bit on CPU: the engine runs the same two programs with the
same shapes (attention over gathered pages is bitwise the dense cache's, see
``rlax_tpu/inference/attention_backends.py``), and XLA's CPU kernels give a row the same bits
whatever the other rows hold. They do *not* give the same bits for every batch size (the matmul
kernel changes with the row count: measured classes 1, 2-15, 16-24, 32+ on x86), so the replay
runs batches of exactly the engine's shapes, padding with idle rows, and never the cheapest one.

Rollout layout (as ``types.TrainBatch``): tokens [B, L] hold prompt (P_b tokens), completion
(C_b tokens), padding; log-probs are completion-aligned [B, T] (entry t scores completion token t).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.models.attention import DenseKVCache
from rlax_tpu.models.generate import check_token_ids
from rlax_tpu.models.transformer import Transformer, make_dense_cache, step


def sampled_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """logits [B, T, V] f32, tokens [B, T] int -> [B, T] f32 log-softmax(logits / temperature)[token]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayShape:
    """The engine's shapes that decide the bits: the rows of one model step (``slots``; a smaller
    batch is padded with idle rows, larger ones are split) and the KV length per sequence."""

    slots: int
    cache_len: int
    prefill_rows: int = 0  # chunks per prefill call; 0: no prefill program
    prefill_len: int = 1  # tokens per chunk

    def prefix(self, prompt_length: int) -> int:
        """Positions of a prompt the prefill program computes (all but the last token)."""
        return prompt_length - 1 if self.prefill_rows else 0


@partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _scored_step(graphdef, state, tokens, positions, cache, targets, temperature):
    logits, cache = step(nnx.merge(graphdef, state), tokens, positions, cache)
    return sampled_logprobs(logits, targets, temperature), cache


@partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _prefill_call(graphdef, state, tokens, positions, cache):
    _, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
    return cache


@partial(jax.jit, donate_argnums=(0,))
def _place(cache: DenseKVCache, group: DenseKVCache, rows: jax.Array, src: jax.Array):
    """cache row rows[i] <- group row src[i]; rows out of range are dropped (padding)."""
    return DenseKVCache(k=cache.k.at[:, rows].set(group.k[:, src], mode="drop"),
                        v=cache.v.at[:, rows].set(group.v[:, src], mode="drop"))  # fmt: skip


def prefill_prefixes(
    model: Transformer, prefixes: list[np.ndarray], cache: DenseKVCache, *, shape: ReplayShape,
) -> DenseKVCache:  # fmt: skip
    """Writes the keys/values of ``prefixes[b]`` (positions 0..len-1) into row b of ``cache``
    ([L, B >= len(prefixes), S, ...]) the way the engine's prefill program computes them: chunks
    [kC, (k+1)C), C = ``shape.prefill_len``, in [prefill_rows, C] calls, one sequence per row of
    a dense [prefill_rows, S] cache, chunk k of a group in call k. A prefix's keys/values do not
    depend on its row, so each distinct prefix (a group's G samples share one) is computed once
    and copied to every row that has it."""
    graphdef, state = nnx.split(model)
    rows, c, batch = shape.prefill_rows, shape.prefill_len, cache.k.shape[1]
    index: dict[bytes, int] = {}
    owners: list[list[int]] = []
    distinct: list[np.ndarray] = []
    for b, x in enumerate(prefixes):
        x = np.asarray(x, np.int32)
        if len(x) == 0:
            continue
        u = index.setdefault(x.tobytes(), len(distinct))
        if u == len(distinct):
            distinct.append(x)
            owners.append([])
        owners[u].append(b)
    for start in range(0, len(distinct), rows):
        group = distinct[start : start + rows]
        small = make_dense_cache(model.cfg, rows, cache.max_len)
        for a in range(0, max(len(x) for x in group), c):
            tokens = np.zeros((rows, c), np.int32)
            positions = np.full((rows, c), -1, np.int32)
            for i, x in enumerate(group):
                part = x[a : a + c]
                tokens[i, : len(part)] = part
                positions[i, : len(part)] = np.arange(a, a + len(part))
            small = _prefill_call(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions),
                                  small)  # fmt: skip
        dst = np.full(batch, batch, np.int32)  # out of range: dropped
        src = np.zeros(batch, np.int32)
        k = 0
        for i in range(len(group)):
            for b in owners[start + i]:
                dst[k], src[k] = b, i
                k += 1
        cache = _place(cache, small, jnp.asarray(dst), jnp.asarray(src))
    return cache


def replay_logprobs(
    model: Transformer,
    tokens: np.ndarray,
    prompt_lengths: np.ndarray,
    completion_lengths: np.ndarray,
    *,
    shape: ReplayShape,
    temperature: float = 1.0,
    width: int | None = None,
) -> np.ndarray:
    """Completion log-probs [B, width] (default width: the longest completion), 0 past each
    completion, computed as the engine computes them (see the module docstring)."""
    tokens = np.asarray(tokens, np.int32)
    prompt = np.asarray(prompt_lengths, np.int64)
    completion = np.asarray(completion_lengths, np.int64)
    b = len(tokens)
    width = int(completion.max(initial=0)) if width is None else width
    out = np.zeros((b, width), np.float32)
    if b == 0 or width == 0:
        return out
    # Host-side checks: inside jit a too-long row's tail is dropped by the cache and an
    # out-of-range id gathers garbage, both silently.
    if prompt.shape != (b,) or completion.shape != (b,):
        raise ValueError(
            f"prompt_lengths {prompt.shape} and completion_lengths {completion.shape} must be "
            f"[B] = ({b},) for tokens of shape {tokens.shape}"
        )
    if (prompt < 1).any() or (completion < 0).any():
        raise ValueError("prompt lengths must be >= 1 and completion lengths >= 0")
    if (prompt + completion).max() > tokens.shape[1]:
        raise ValueError(
            f"a rollout of {(prompt + completion).max()} tokens is longer than the tokens array "
            f"({tokens.shape[1]} columns)"
        )
    live = np.arange(tokens.shape[1])[None, :] < (prompt + completion)[:, None]
    check_token_ids(np.where(live, tokens, 0), model.cfg.vocab_size, "replay_logprobs: tokens")
    if (prompt + completion).max() > shape.cache_len:
        raise ValueError(
            f"a rollout of {(prompt + completion).max()} tokens does not fit the replay's "
            f"cache of {shape.cache_len} positions"
        )
    for start in range(0, b, shape.slots):
        rows = slice(start, min(b, start + shape.slots))
        out[rows] = _replay_rows(
            model, tokens[rows], prompt[rows], completion[rows], shape=shape,
            temperature=temperature, width=width,
        )  # fmt: skip
    return out


def _replay_rows(model, tokens, prompt, completion, *, shape, temperature, width):  # noqa: ANN001, ANN202
    n, slots = len(tokens), shape.slots
    graphdef, state = nnx.split(model)
    prefix = np.array([shape.prefix(int(x)) for x in prompt] + [0] * (slots - n))
    tokens = np.pad(tokens, ((0, slots - n), (0, 1)))  # idle rows; one spare column
    total = np.concatenate([prompt + completion, np.zeros(slots - n, np.int64)])
    prompt = np.concatenate([prompt, np.ones(slots - n, np.int64)])
    length = tokens.shape[1]
    cache = make_dense_cache(model.cfg, slots, shape.cache_len)
    if shape.prefill_rows:
        cache = prefill_prefixes(model, [tokens[i, : prefix[i]] for i in range(n)], cache,
                                 shape=shape)  # fmt: skip
    out = np.zeros((slots, width), np.float32)
    temperature = jnp.float32(temperature)
    # Step i feeds, in every row b, the token at position q = prefix_b + i (rows at their own
    # positions, as the engine's decode rows are) and scores the next one: completion token
    # q + 1 - P_b.
    span = total - 1 - prefix
    rows = np.arange(slots)
    for i in range(int(span.max())):
        q = prefix + i
        live = i < span
        fed = tokens[rows, np.minimum(q, length - 1)]
        targets = tokens[rows, np.minimum(q + 1, length - 1)]
        positions = np.where(live, q, -1)
        logp, cache = _scored_step(
            graphdef, state, jnp.asarray(fed[:, None]), jnp.asarray(positions[:, None], jnp.int32),
            cache, jnp.asarray(targets[:, None]), temperature,
        )  # fmt: skip
        t = q + 1 - prompt
        hit = live & (t >= 0) & (t < width)
        out[hit, t[hit]] = np.asarray(logp)[hit, 0]
    return out[:n]
