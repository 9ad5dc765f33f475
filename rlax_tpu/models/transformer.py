"""The decoder-only transformer and its two entry points.

``forward``      full sequences (training, log-prob recompute): logits [B, T, V] in f32.
``step``         a chunk of T tokens per sequence against a KV cache (prefill, chunked prefill,
                 decode): logits and the updated cache.
Both run ``Transformer.__call__``; they differ only in the :class:`KVCache` they pass.

:class:`LayerLoop` says how ``__call__`` runs its layers: unrolled (the default; program size
and compile time grow with depth) or as one ``jax.lax.scan`` over the layers' stacked
parameters (one compiled layer body whatever the depth), each layer optionally under
``jax.checkpoint`` with a named policy. Scan and remat need a cache that stores nothing and
ignores the layer index (``stateless``: the full-sequence forward's).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.attention import DenseKVCache, KVCache, NoCache
from rlax_tpu.models.layers import MLP, Attention, RMSNorm, dtypes, normal_init, param
from rlax_tpu.models.moe import MoE
from rlax_tpu.models.rope import rope_tables
from rlax_tpu.models.sharding import constrain, param_shardings

_ACT = ("batch", "length", "act_embed")

REMAT_POLICIES = {
    # Only each layer's input is kept for the backward pass: the forward fuses as at inference
    # (RLAX §5) and activation memory is one layer's input per layer.
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """How the layers run: ``scan`` over stacked layer parameters or unrolled; ``remat`` a
    :data:`REMAT_POLICIES` name (each layer under ``jax.checkpoint``) or None."""

    scan: bool = False
    remat: str | None = None

    def __post_init__(self) -> None:
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"unknown remat policy {self.remat!r}; one of {sorted(REMAT_POLICIES)}"
            )

    @property
    def plain(self) -> bool:
        return not self.scan and self.remat is None


UNROLLED = LayerLoop()  # layers one after the other, nothing rematerialized


class DecoderLayer(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(x)) (a MoE when the config has experts)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, "norm", rngs=rngs)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, "norm", rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs) if cfg.num_experts else MLP(cfg, rngs=rngs, layer=layer)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        routes: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache, Routing | None]:
        """x [B, T, E] -> (x, cache, this layer's routing or None for a dense MLP); ``routes``
        [B, T, k]: the experts to force (``moe.py``)."""
        h, cache = self.attn(self.input_norm(x), cos, sin, positions, cache)
        x = x + h
        if isinstance(self.mlp, MoE):
            y, logits, experts = self.mlp(
                self.post_attn_norm(x), forced=routes, valid=positions >= 0
            )
            return x + y, cache, Routing(logits, experts)
        return x + self.mlp(self.post_attn_norm(x)), cache, None


class Routing(NamedTuple):
    """A MoE model's routing: router logits [L, B, T, X] f32 and the experts each token went
    to [L, B, T, k] int32 (one layer's without the L axis)."""

    logits: jax.Array
    experts: jax.Array


class Transformer(nnx.Module):
    """Llama / Qwen2 / Qwen3 (and Qwen3-MoE / Mixtral) decoder. Parameter tree (logical axes in brackets):

    embed [vocab, embed]; layers[i].{input_norm, post_attn_norm}.weight [norm];
    layers[i].attn.{q,k,v}_proj [embed, heads|kv_heads, head_dim], o_proj [heads, head_dim, embed],
    optional {q,k,v}_bias [heads|kv_heads, head_dim], optional o_bias [embed] (Llama / Qwen3
    attention_bias), optional {q,k}_norm.weight [head_dim];
    layers[i].mlp.{gate,up}_proj [embed, mlp], down_proj [mlp, embed], or with experts
    (``moe.py``) layers[i].mlp.router [embed, experts], {gate,up}_proj [experts, embed, mlp],
    down_proj [experts, mlp, embed]; final_norm.weight [norm];
    lm_head [embed, vocab] unless embeddings are tied.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdtype, self.compute_dtype = dtypes(cfg)
        self.cfg = cfg
        self.embed = param(
            rngs, normal_init, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pdtype
        )
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, "norm", rngs=rngs)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(
                rngs, normal_init, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pdtype
            )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        loop: LayerLoop = UNROLLED,
    ) -> tuple[jax.Array, KVCache]:
        """tokens, positions [B, T] int32 -> (final-normed hidden states [B, T, E], cache)."""
        hidden, cache, _ = self.run(tokens, positions, cache, loop)
        return hidden, cache

    def run(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        loop: LayerLoop = UNROLLED,
        routes: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache, Routing | None]:
        """``__call__`` and, for a MoE model, its :class:`Routing` (None for a dense one).
        ``routes`` [L, B, T, k]: the experts every layer must use (routing replay)."""
        if routes is not None and not self.cfg.num_experts:
            raise ValueError("routes given to a model without experts")
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.compute_dtype)
        x = constrain(x, _ACT)
        cos, sin = rope_tables(self.cfg, positions)
        if loop.plain:
            per_layer = []
            for i, layer in enumerate(self.layers):
                x, cache, routing = layer(
                    x, cos, sin, positions, cache, None if routes is None else routes[i]
                )
                x = constrain(x, _ACT)
                per_layer.append(routing)
            routing = _stacked(per_layer)
        else:
            x, routing = self._layer_loop(x, cos, sin, positions, cache, loop, routes)
        return self.final_norm(x), cache, routing

    def _layer_loop(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        loop: LayerLoop,
        routes: jax.Array | None,
    ) -> tuple[jax.Array, Routing | None]:
        if not getattr(cache, "stateless", False):
            raise ValueError(
                f"scanned or rematerialized layers need a stateless cache (one that stores "
                f"nothing and ignores the layer index), not {type(cache).__name__}"
            )
        # Layers differ only in their static layer index, which a stateless cache ignores, so
        # every layer runs layer 0's graph with its own parameters.
        graphdef = nnx.graphdef(self.layers[0])

        def run(
            state: nnx.State, x: jax.Array, forced: jax.Array | None
        ) -> tuple[jax.Array, Routing | None]:
            y, _, routing = nnx.merge(graphdef, state)(x, cos, sin, positions, cache, forced)
            return constrain(y, _ACT), routing

        if loop.remat is not None:
            run = jax.checkpoint(run, policy=REMAT_POLICIES[loop.remat])
        states = [nnx.state(layer) for layer in self.layers]
        if not loop.scan:
            per_layer = []
            for i, state in enumerate(states):
                x, routing = run(state, x, None if routes is None else routes[i])
                per_layer.append(routing)
            return x, _stacked(per_layer)
        stack = partial(_stack_layers, dtype=self.compute_dtype)
        stacked = jax.tree.map(stack, *states, is_leaf=_is_variable)
        x, routing = jax.lax.scan(lambda h, xs: run(xs[0], h, xs[1]), x, (stacked, routes))
        return x, routing

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, T, E] -> logits [B, T, V], accumulated and returned in f32."""
        c = self.compute_dtype
        if self.lm_head is None:
            w = self.embed[...].astype(c)
            return jnp.einsum("bte,ve->btv", hidden, w, preferred_element_type=jnp.float32)
        w = self.lm_head[...].astype(c)
        return jnp.einsum("bte,ev->btv", hidden, w, preferred_element_type=jnp.float32)


def _stacked(per_layer: list[Routing | None]) -> Routing | None:
    """The layers' routings on a leading layer axis (None for a dense model)."""
    if per_layer[0] is None:
        return None
    return Routing(*(jnp.stack(parts) for parts in zip(*per_layer, strict=True)))


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def _stack_layers(*variables: nnx.Variable, dtype: jnp.dtype) -> nnx.Variable:
    """The layers' values of one parameter stacked on a new leading axis [num_layers, ...],
    constrained like the parameter (the layer axis replicated). A floating parameter its layer
    casts to the compute ``dtype`` where used is cast before the stack, as the unrolled layers
    cast it (the same values and gradients): stacking float32 masters made a float32 copy of
    every layer, and a float32 cotangent, that nothing needs."""
    first = variables[0]
    values = [v[...] for v in variables]
    if jnp.issubdtype(values[0].dtype, jnp.floating) and not first.get_metadata().get(
        "used_as_stored"
    ):
        values = [x.astype(dtype) for x in values]
    stacked = jnp.stack(values)
    axes = first.get_metadata().get("out_sharding") or (None,) * (stacked.ndim - 1)
    return first.replace(constrain(stacked, (None, *axes)))


def init_model(
    cfg: ModelConfig, *, seed: int | None = None, mesh: Mesh | None = None
) -> Transformer:
    """A randomly initialized model (seed defaults to ``cfg.seed``).

    With ``mesh``, parameters are created already sharded by the rules table (the init runs
    under ``jax.jit`` with those output shardings, so no device holds a full copy).
    """
    seed = cfg.seed if seed is None else seed
    graphdef, create = _creator(cfg, mesh)
    return nnx.merge(graphdef, create(jax.random.key(seed)))


@functools.lru_cache(maxsize=16)
def _creator(cfg: ModelConfig, mesh: Mesh | None) -> tuple[nnx.GraphDef, Callable]:
    """The model's graph and its jitted init, which takes the key: one program for every seed
    (a seed baked in as a constant made a program per seed), traced once per config and mesh.
    nnx.Rngs(key(s)) draws what nnx.Rngs(s) does."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shardings = None if mesh is None else param_shardings(abstract, mesh)

    # Always jitted, so that the values do not depend on whether a mesh is given.
    @partial(jax.jit, out_shardings=shardings)
    def create(key: jax.Array) -> nnx.State:
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(key)))

    return graphdef, create


def default_positions(tokens: jax.Array) -> jax.Array:
    """[B, T] positions 0..T-1 for unpadded sequences."""
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def forward(model: Transformer, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Full-sequence forward: tokens [B, T] int32 -> logits [B, T, V] f32.

    ``positions`` [B, T] defaults to 0..T-1; mark padding with negative positions (left padding:
    start the real tokens at 0). Causal by position within each row.
    """
    positions = default_positions(tokens) if positions is None else positions
    hidden, _ = model(tokens, positions, NoCache())
    return model.logits(hidden)


def step(
    model: Transformer, tokens: jax.Array, positions: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """One cached step over a chunk: tokens, positions [B, T] -> (logits [B, T, V] f32, cache).

    Serves prefill (T = prompt length), chunked prefill and decode (T = 1). Padding slots have
    negative positions; they are not written to the cache.
    """
    hidden, cache = model(tokens, positions, cache)
    return model.logits(hidden), cache


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(targets) under logits: [B, T, V] f32, [B, T] int -> [B, T] f32."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - logz


def make_dense_cache(cfg: ModelConfig, batch: int, max_len: int) -> DenseKVCache:
    """An empty dense cache for ``batch`` sequences of up to ``max_len`` tokens (compute dtype)."""
    return DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=batch,
        max_len=max_len,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.resolved_head_dim,
        dtype=jnp.dtype(cfg.compute_dtype),
    )
