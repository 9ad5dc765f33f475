"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a top-k softmax router and SwiGLU
experts computed as grouped matmuls over the tokens each expert received.

Routing (as the HF implementations do, but with x · router accumulated and kept in float32, as
MaxText's float32 gate logits; HF rounds it to the model's dtype): p = softmax(x · router) over
the E experts; each token takes the k experts of highest p, weighted by their p, renormalized to
sum to 1 when
``norm_topk_prob``. The chosen (token, expert) pairs are sorted by expert and each expert's SwiGLU
runs on its rows only (a grouped matmul, :mod:`rlax_tpu.models.grouped_matmul`: XLA's
``jax.lax.ragged_dot`` or, on TPU, the megablox Pallas kernels): no expert computes a token it
was not given, and no capacity limit drops one (every assignment is computed; the sort's cost
is N·k rows).

``forced`` routes: the experts to use instead of the router's top k (routing replay: the engine's
choices in the trainer's forward). The weights are then the router's current probabilities of
those experts, so the router still learns. A token whose forced row holds a negative entry (a
position the engine did not record) takes the router's own top k.

Padding (``valid`` false: a position of -1, as batches pad) goes to no expert: its experts are -1
and its weights 0, so the grouped matmuls never see it and its output is 0. A padded row of a
length-sorted micro-batch is mostly padding; routed, it was computed k times, piling up on
whichever experts the router gave its identical rows.

Expert parallelism (a mesh whose ``expert`` axis has D > 1 devices): each device holds X/D of the
experts (the rules put a layer's experts axis on it) and, the batch being split over expert as
over fsdp, its own rows. In a ``jax.shard_map`` every device routes its rows, all-gathers the
rows, their experts and weights of its expert group, runs its own experts on the rows routed to
them (the others give zeros), and a reduce-scatter over the group sums each row's pairs and
hands it back to its device. No capacity: every assignment is computed, nothing is dropped
(the buffer is the group's N·k rows). Bytes: the gather and the reduce-scatter each move
(D - 1)/D of the group's N·E activations a device, as one all-to-all dispatch of top-k rows
moves k·(D - 1)/D of its own N·E, and its return as much again: the same for D = k, less for
D < k (Qwen3-30B-A3B's k = 8 over up to 8 expert devices), more past it. Rows the batch axes do
not split (a decode step's) are on every device already and only the sum remains (a psum).
With a tensor axis each expert's width is split too, and its partial sums psum'd.

Gradients of the router and the experts are summed across devices in the parameters' dtype
(float32 masters), not the compute dtype: the weights enter the ``shard_map`` as they are stored
(the experts split over fsdp as their layout has them) and are cast inside it; the experts'
all-gather over fsdp moves the compute dtype forward and its transpose reduce-scatters the
gradient in the parameters' dtype (:func:`_gather_cast`); the sum over the axes the weights are
replicated on (data) is the ``shard_map``'s, in the parameters' dtype too. A bf16 sum would add
about 2^-8 of relative noise a reduction.

Shapes: N tokens, E hidden, X experts, k experts per token, F expert width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.grouped_matmul import grouped_matmul, resolve_kernel
from rlax_tpu.models.layers import dtypes, normal_init, param
from rlax_tpu.models.sharding import LOGICAL_AXIS_RULES, manual_axes

EXPERT_AXIS = LOGICAL_AXIS_RULES["experts"]  # the mesh axis a layer's experts are split over
TENSOR_AXIS = LOGICAL_AXIS_RULES["mlp"]  # and each expert's width
FSDP_AXIS = LOGICAL_AXIS_RULES["embed"][0]  # and each expert's model dimension (ZeRO-3)


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
    kernel: str = "ragged_dot",
) -> jax.Array:
    """Each row of x [N, E] through each of its experts [N, k]: [N, k, E]. gate, up [X, E, F],
    down [X, F, E]. Rows are sorted by expert so each expert multiplies only its own. An expert
    id outside [0, X) (another device's expert under expert parallelism) gives zeros.
    ``kernel``: the grouped matmul's (``model.expert_kernel``)."""
    n, k = experts.shape
    num = gate.shape[0]
    flat = experts.reshape(-1)
    mine = (flat >= 0) & (flat < num)
    key = jnp.where(mine, flat, num)  # the others sort last, past every group
    order = jnp.argsort(key, stable=True)
    used = jnp.take(mine, order)[:, None]
    # Rows past the groups are zeroed going in as coming out: what a grouped kernel leaves
    # there (forward or transposed) is not specified, and must reach no gradient.
    rows = jnp.where(used, jnp.take(x, order // k, axis=0), 0)  # [N·k, E], grouped by expert
    sizes = jnp.bincount(key, length=num + 1)[:num].astype(jnp.int32)
    matmul = partial(grouped_matmul, sizes=sizes, kernel=kernel)
    hidden = jax.nn.silu(matmul(rows, gate)) * matmul(rows, up)
    out = matmul(hidden, down)  # [N·k, E] in sorted order
    out = jnp.where(used, out, jnp.zeros_like(out))
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return unsorted.reshape(n, k, -1)


class MoE(nnx.Module):
    """router [embed, experts]; gate_proj, up_proj [experts, embed, expert_mlp];
    down_proj [experts, expert_mlp, embed]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdtype, self.compute_dtype = dtypes(cfg)
        e, x, f = cfg.hidden_size, cfg.num_experts, cfg.resolved_expert_intermediate_size
        self.k, self.normalize = cfg.experts_per_token, cfg.norm_topk_prob
        self.kernel = cfg.expert_kernel
        # Taken as stored into the expert-parallel shard_map (module docstring).
        stored = partial(param, rngs, normal_init, dtype=pdtype, used_as_stored=True)
        self.router = stored((e, x), ("embed", "experts"))
        self.gate_proj = stored((x, e, f), ("experts", "embed", "mlp"))
        self.up_proj = stored((x, e, f), ("experts", "embed", "mlp"))
        self.down_proj = stored((x, f, e), ("experts", "mlp", "embed"))

    def __call__(
        self, x: jax.Array, forced: jax.Array | None = None, valid: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, E] -> (y [B, T, E], router logits [B, T, X] f32, experts [B, T, k]).
        ``forced`` [B, T, k]: the experts to use; ``valid`` [B, T] bool: the tokens that are not
        padding (module docstring; None: every token)."""
        c = self.compute_dtype
        b, t, e = x.shape
        flat = x.reshape(b * t, e)
        weights = [w[...] for w in (self.router, self.gate_proj, self.up_proj, self.down_proj)]
        if forced is not None:
            forced = forced.reshape(b * t, self.k)
        if valid is not None:
            valid = valid.reshape(b * t)
        mesh = jax.sharding.get_abstract_mesh()
        kernel = resolve_kernel(self.kernel)
        # A Pallas kernel cannot be partitioned by XLA: on any mesh of several devices the
        # layer runs in its shard_map, which is expert parallelism over an expert axis of 1.
        in_shard_map = (not mesh.empty) and (
            mesh.shape.get(EXPERT_AXIS, 1) > 1 or (kernel != "ragged_dot" and mesh.size > 1)
        )
        local = partial(self._local, kernel=kernel)
        if in_shard_map:
            y, logits, experts = _expert_parallel(
                local, mesh, flat, *weights, forced, valid, dtype=c
            )
        else:
            y, logits, experts = local(flat, *(w.astype(c) for w in weights), forced, valid)
        return (
            y.reshape(b, t, e),
            logits.reshape(b, t, -1),
            experts.reshape(b, t, self.k),
        )

    def _local(
        self,
        x: jax.Array,
        router: jax.Array,
        gate: jax.Array,
        up: jax.Array,
        down: jax.Array,
        forced: jax.Array | None,
        valid: jax.Array | None,
        gather: Callable[[jax.Array], jax.Array] = lambda a: a,
        first: jax.Array | int = 0,
        *,
        kernel: str = "ragged_dot",
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [N, E] -> (y [N', E], logits [N, X] f32, experts [N, k]) through the experts of
        gate/up/down, which are experts first..first+X' of the layer. ``gather`` makes the rows
        y covers (N' of them) from each row's own (x, experts, weights): identity on one device."""
        # Float32 gate logits (as MaxText's float32_gate_logits): in the compute dtype the
        # product is rounded before the top k, so near-ties pick experts by rounding.
        logits = jnp.matmul(x, router, preferred_element_type=jnp.float32)
        weights, experts = route(logits, self.k, normalize=self.normalize, forced=forced)
        if valid is not None:  # padding: no expert, no weight
            experts = jnp.where(valid[:, None], experts, -1)
            weights = jnp.where(valid[:, None], weights, 0.0)
        xs, es, ws = gather(x), gather(experts), gather(weights)
        outs = grouped_swiglu(xs, es - first, gate, up, down, kernel)
        y = jnp.einsum("nke,nk->ne", outs, ws.astype(x.dtype))
        return y, logits, experts


def _expert_parallel(
    local: Callable[..., tuple[jax.Array, jax.Array, jax.Array]],
    mesh: jax.sharding.AbstractMesh,
    x: jax.Array,
    router: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    forced: jax.Array | None,
    valid: jax.Array | None,
    *,
    dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE with its experts split over the mesh's expert axis (module docstring, "Expert
    parallelism"; an axis of 1 leaves each device every expert, its rows and its slice of the
    width): x [N, E] -> (y [N, E], logits [N, X], experts [N, k]), as ``local``; the weights
    as stored, computed in ``dtype`` (module docstring: gradients summed in theirs)."""
    names, manual = mesh.axis_names, manual_axes(mesh)
    batch = tuple(
        a
        for a in LOGICAL_AXIS_RULES["batch"]
        if a in names and mesh.shape[a] > 1 and a not in manual
    )
    rows = batch if batch and x.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else ()
    width = gate.shape[-1]
    tp = mesh.shape.get(TENSOR_AXIS, 1)
    tensor = TENSOR_AXIS if tp > 1 and width % tp == 0 and TENSOR_AXIS not in manual else None
    row_spec = P(rows or None, None)
    experts_axis = EXPERT_AXIS if EXPERT_AXIS in names and EXPERT_AXIS not in manual else None
    ep = mesh.shape[experts_axis] if experts_axis else 1
    if gate.shape[0] % ep:
        raise ValueError(f"mesh.expert = {ep} does not divide the model's {gate.shape[0]} experts")
    spread = EXPERT_AXIS in rows  # each expert device holds other tokens
    fs = mesh.shape.get(FSDP_AXIS, 1)
    fsdp = FSDP_AXIS if fs > 1 and x.shape[1] % fs == 0 and FSDP_AXIS not in manual else None

    def body(x, router, gate, up, down, forced, valid):  # noqa: ANN001, ANN202
        router = router.astype(dtype)
        gate, up = (_gather_cast(w, fsdp, 1, dtype) for w in (gate, up))
        down = _gather_cast(down, fsdp, 2, dtype)
        first = jax.lax.axis_index(experts_axis) * gate.shape[0] if experts_axis else 0
        gather = (
            (lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True))
            if spread
            else (lambda a: a)
        )
        y, logits, experts = local(x, router, gate, up, down, forced, valid, gather, first)
        if tensor is not None:  # each device's slice of the expert width: partial sums
            y = jax.lax.psum(y, tensor)
        # Every (token, expert) pair was computed on the one device holding the expert.
        if spread:
            y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        elif experts_axis:
            y = jax.lax.psum(y, experts_axis)
        return y, logits, experts

    w_in, w_out = P(experts_axis, fsdp, tensor), P(experts_axis, tensor, fsdp)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            row_spec,
            P(),
            w_in,
            w_in,
            w_out,
            None if forced is None else row_spec,
            None if valid is None else P(rows or None),
        ),
        out_specs=(row_spec, row_spec, row_spec),
        axis_names=set(names) - manual,
        # Off: the megablox kernels' outputs declare no varying axes, which the check requires.
        # Unchecked, the transpose sums a replicated input's cotangent over the axes it is
        # replicated on (the tests compare every gradient with one device's).
        check_vma=False,
    )(x, router, gate, up, down, forced, valid)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_cast(w: jax.Array, axis: str | None, dim: int, dtype: jnp.dtype) -> jax.Array:
    """``w`` (a device's slice, split over ``axis`` along ``dim``) cast to ``dtype`` and
    all-gathered whole; the transpose reduce-scatters the cotangent in ``w``'s own dtype (not
    ``dtype``: the gradient is summed at the parameters' precision). ``axis`` None: the cast."""
    w = w.astype(dtype)
    return w if axis is None else jax.lax.all_gather(w, axis, axis=dim, tiled=True)


def _gather_cast_fwd(w, axis, dim, dtype):  # noqa: ANN001, ANN202
    return _gather_cast(w, axis, dim, dtype), jnp.zeros((), w.dtype)


def _gather_cast_bwd(axis, dim, dtype, like, ct):  # noqa: ANN001, ANN202
    ct = ct.astype(like.dtype)
    if axis is not None:
        ct = jax.lax.psum_scatter(ct, axis, scatter_dimension=dim, tiled=True)
    return (ct,)


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)


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
