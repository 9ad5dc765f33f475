"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a top-k softmax router and SwiGLU
experts computed as grouped matmuls over the tokens each expert received.

Routing (as the HF implementations do): p = softmax(x · router) in f32 over the E experts; each
token takes the k experts of highest p, weighted by their p, renormalized to sum to 1 when
``norm_topk_prob``. The chosen (token, expert) pairs are sorted by expert and each expert's SwiGLU
runs on its rows only (``jax.lax.ragged_dot``): no expert computes a token it was not given, and
no capacity limit drops one (every assignment is computed; the sort's cost is N·k rows).

``forced`` routes: the experts to use instead of the router's top k (routing replay: the engine's
choices in the trainer's forward). The weights are then the router's current probabilities of
those experts, so the router still learns. A token whose forced row holds a negative entry (a
position the engine did not record, padding) takes the router's own top k.

Shapes: N tokens, E hidden, X experts, k experts per token, F expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.layers import dtypes, normal_init, param


def route(
    logits: jax.Array, k: int, *, normalize: bool, forced: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, X] -> (weights [N, k] f32, experts [N, k] int32), per the module
    docstring; ``forced`` [N, k] gives the experts (a row with a negative entry: the top k)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if forced is not None:
        forced = forced.astype(jnp.int32)
        given = jnp.all(forced >= 0, axis=-1, keepdims=True)
        experts = jnp.where(given, forced, experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_swiglu(
    x: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """Each row of x [N, E] through each of its experts [N, k]: [N, k, E]. gate, up [X, E, F],
    down [X, F, E]. Rows are sorted by expert so each expert multiplies only its own."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x, order // k, axis=0)  # [N·k, E], grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(
        rows, up, sizes
    )
    out = jax.lax.ragged_dot(hidden, down, sizes)  # [N·k, E] in sorted order
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return unsorted.reshape(n, k, -1)


class MoE(nnx.Module):
    """router [embed, experts]; gate_proj, up_proj [experts, embed, expert_mlp];
    down_proj [experts, expert_mlp, embed]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdtype, self.compute_dtype = dtypes(cfg)
        e, x, f = cfg.hidden_size, cfg.num_experts, cfg.resolved_expert_intermediate_size
        self.k, self.normalize = cfg.experts_per_token, cfg.norm_topk_prob
        self.router = param(rngs, normal_init, (e, x), ("embed", "experts"), pdtype)
        self.gate_proj = param(rngs, normal_init, (x, e, f), ("experts", "embed", "mlp"), pdtype)
        self.up_proj = param(rngs, normal_init, (x, e, f), ("experts", "embed", "mlp"), pdtype)
        self.down_proj = param(rngs, normal_init, (x, f, e), ("experts", "mlp", "embed"), pdtype)

    def __call__(
        self, x: jax.Array, forced: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, E] -> (y [B, T, E], router logits [B, T, X] f32, experts [B, T, k]).
        ``forced`` [B, T, k]: the experts to use (module docstring)."""
        c = self.compute_dtype
        b, t, e = x.shape
        flat = x.reshape(b * t, e)
        logits = flat @ self.router[...].astype(c)
        weights, experts = route(
            logits,
            self.k,
            normalize=self.normalize,
            forced=None if forced is None else forced.reshape(b * t, self.k),
        )
        outs = grouped_swiglu(
            flat,
            experts,
            self.gate_proj[...].astype(c),
            self.up_proj[...].astype(c),
            self.down_proj[...].astype(c),
        )
        y = jnp.einsum("nke,nk->ne", outs, weights.astype(c))
        return (
            y.reshape(b, t, e),
            logits.astype(jnp.float32).reshape(b, t, -1),
            experts.reshape(b, t, self.k),
        )


def load_balancing_loss(
    logits: jax.Array, k: int, mask: jax.Array | None = None, experts: jax.Array | None = None
) -> jax.Array:
    """The auxiliary load-balancing loss of Switch Transformer (Fedus et al. 2021, eqs. 4-6)
    with top-k routing, over every layer's tokens together as HF's ``load_balancing_loss_func``
    computes it: X · Σ_x f_x · P_x, where over the (layer, token) rows R with mask 1, f_x is the
    number of assignments to expert x over R (the f sum to k) and P_x the mean router
    probability of x. Only P carries a gradient.

    logits [L, B, T, X]; mask [B, T] (default: every token); experts [L, B, T, k]: the
    assignments made (default: each row's top k, as without forced routes)."""
    x = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if experts is None:
        _, experts = jax.lax.top_k(probs, k)
    w = jnp.ones(logits.shape[:-1], jnp.float32)
    if mask is not None:
        w = w * mask.astype(jnp.float32)[None]
    rows = jnp.maximum(jnp.sum(w), 1.0)
    assigned = jnp.sum(jax.nn.one_hot(experts, x, dtype=jnp.float32), axis=-2)  # [L, B, T, X]
    f = jnp.sum(assigned * w[..., None], axis=(0, 1, 2)) / rows
    p = jnp.sum(probs * w[..., None], axis=(0, 1, 2)) / rows
    return x * jnp.sum(jax.lax.stop_gradient(f) * p)
