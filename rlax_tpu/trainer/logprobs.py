"""Completion log-probs (and values) from a full-sequence forward, for training and scoring.

Shapes: B rows, L token columns (prompt, completion, padding), T completion columns, E hidden,
V vocab. Completion token t of row b sits at column P_b + t and is predicted by the hidden state
at column P_b + t - 1, so the forward gathers those T hidden states per row before the vocab
projection (the prompt's logits are never formed).

The vocab projection and log-softmax have two implementations that agree to f32 rounding:
``plain_logprobs`` (the partitioner decides) and ``vocab_parallel_logprobs`` (``jax.shard_map``
over the tensor axis: each device forms the logits of its vocab slice only and combines max,
sum-exp and the target's logit with three small collectives, so the [B, T, V] logits are never
gathered).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from rlax_tpu import models
from rlax_tpu.trainer.mesh import BATCH_AXES, TENSOR_AXIS


def hidden_states(
    model: models.Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    loop: models.LayerLoop = models.UNROLLED,
    attention: str | models.KVCache = "dense",
    routes: jax.Array | None = None,
) -> tuple[jax.Array, models.Routing | None]:
    """tokens, positions [B, L] -> (final-normed hidden states [B, L, E], a MoE model's routing
    or None); ``attention`` is the kernel of ``models.NoCache`` (splash needs each row's tokens
    first, as batching lays them) or a stateless cache (the prefill-shaped π_old recompute),
    ``loop`` how the layers run (scanned or unrolled, remat policy); ``routes`` [B, L, layers,
    k] the experts to force (routing replay; -1: the router's own, ``models.moe``)."""
    cache = models.NoCache(kernel=attention) if isinstance(attention, str) else attention
    forced = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [layers, B, L, k]
    hidden, _, routing = model.run(tokens, positions, cache, loop, forced)
    return hidden, routing


def gather_completion(hidden: jax.Array, prompt_lengths: jax.Array, width: int) -> jax.Array:
    """hidden [B, L, E] -> [B, width, E]: the states that predict completion tokens 0..width-1."""
    cols = prompt_lengths[:, None] - 1 + jnp.arange(width)[None, :]
    cols = jnp.clip(cols, 0, hidden.shape[1] - 1)
    return jnp.take_along_axis(hidden, cols[..., None], axis=1)


def plain_logprobs(
    model: models.Transformer, hidden: jax.Array, targets: jax.Array, temperature: jax.Array
) -> jax.Array:
    """hidden [B, T, E], targets [B, T] -> log-softmax(logits / temperature)[target] [B, T] f32."""
    logits = model.logits(hidden) / temperature
    return models.token_logprobs(logits, targets)


def vocab_parallel_logprobs(
    model: models.Transformer,
    hidden: jax.Array,
    targets: jax.Array,
    temperature: jax.Array,
    mesh: Mesh,
) -> jax.Array:
    """As ``plain_logprobs``, with the vocab split over the mesh's tensor axis (see module doc).

    Needs V divisible by the tensor axis size; rows split over the batch axes.
    """
    tied = model.lm_head is None
    weight = (model.embed if tied else model.lm_head)[...].astype(hidden.dtype)
    w_spec = PartitionSpec(TENSOR_AXIS, None) if tied else PartitionSpec(None, TENSOR_AXIS)
    rows = PartitionSpec(BATCH_AXES, None)

    def local(h, w, tgt, temp):  # noqa: ANN001, ANN202
        eq = "bte,ve->btv" if tied else "bte,ev->btv"
        logits = jnp.einsum(eq, h, w, preferred_element_type=jnp.float32) / temp
        vocab_local = logits.shape[-1]
        # The max only stabilizes the exponentials; it cancels in the result.
        top = jax.lax.pmax(jax.lax.stop_gradient(logits.max(axis=-1)), TENSOR_AXIS)
        sum_exp = jax.lax.psum(jnp.exp(logits - top[..., None]).sum(axis=-1), TENSOR_AXIS)
        offset = tgt - jax.lax.axis_index(TENSOR_AXIS) * vocab_local
        here = (offset >= 0) & (offset < vocab_local)
        picked = jnp.take_along_axis(logits, jnp.clip(offset, 0, vocab_local - 1)[..., None], -1)
        picked = jax.lax.psum(jnp.where(here, picked[..., 0], 0.0), TENSOR_AXIS)
        return picked - top - jnp.log(sum_exp)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(BATCH_AXES, None, None), w_spec, rows, PartitionSpec()),
        out_specs=rows,
    )(hidden, weight, targets, temperature)


def use_vocab_parallel(mesh: Mesh | None, vocab_size: int) -> bool:
    """Vocab-parallel pays off when the vocab is split over a tensor axis."""
    if mesh is None:
        return False
    tp = mesh.shape[TENSOR_AXIS]
    return tp > 1 and vocab_size % tp == 0


def completion_logprobs(
    model: models.Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    prompt_lengths: jax.Array,
    targets: jax.Array,
    temperature: jax.Array,
    *,
    loop: models.LayerLoop,
    mesh: Mesh | None,
    value_head: dict[str, jax.Array] | None = None,
    attention: str | models.KVCache = "dense",
    routes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, models.Routing | None]:
    """Log-probs [B, T] of the completion ``targets`` [B, T]; with a value head, the values
    [B, T] (f32) of the states that emit them; a MoE model's routing of every token (layers
    first, ``models.Routing``; else None). tokens/positions [B, L] (padding at position -1);
    ``routes`` [B, L, layers, k]: the experts to force (:func:`hidden_states`)."""
    hidden, routing = hidden_states(
        model, tokens, positions, loop=loop, attention=attention, routes=routes
    )
    hidden = gather_completion(hidden, prompt_lengths, targets.shape[1])
    if use_vocab_parallel(mesh, model.cfg.vocab_size):
        logp = vocab_parallel_logprobs(model, hidden, targets, temperature, mesh)
    else:
        logp = plain_logprobs(model, hidden, targets, temperature)
    values = None
    if value_head is not None:
        h = hidden.astype(jnp.float32)
        values = h @ value_head["w"].astype(jnp.float32) + value_head["b"].astype(jnp.float32)
    return logp, values, routing
