"""Transformer building blocks: RMSNorm, grouped-query attention (optional QKV bias / QK-norm),
and the SwiGLU MLP (the decoder layer that joins them is in ``transformer.py``).

Parameters are stored in ``param_dtype`` and cast to ``compute_dtype`` where used. Every
parameter carries logical axis names (see ``sharding.LOGICAL_AXIS_RULES``). Shapes:
B batch, T tokens, E hidden, H / Hkv query / KV heads, D head dim, F MLP width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.config import ModelConfig
from rlax_tpu.config.model import LORA_TARGETS
from rlax_tpu.models.attention import KVCache
from rlax_tpu.models.rope import apply_rope

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]
INIT_STDDEV = 0.02  # HF's initializer_range for these families
_LORA_STREAM = 0x10A  # folded into the model seed for adapter inits


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str],
    dtype: jnp.dtype,
    *,
    used_as_stored: bool = False,
) -> nnx.Param:
    """A parameter with logical axis names; sharding is applied later by the rules table.
    ``used_as_stored``: its module takes it in the stored dtype and casts later itself (the
    MoE's, whose gradients are summed in it), so scanned layers stack it uncast."""
    value = init(rngs.params(), shape, dtype)
    if used_as_stored:
        return nnx.Param(value, eager_sharding=False, out_sharding=axes, used_as_stored=True)
    return nnx.Param(value, eager_sharding=False, out_sharding=axes)


def normal_init(key: jax.Array, shape: Sequence[int], dtype: jnp.dtype) -> jax.Array:
    return (INIT_STDDEV * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def ones_init(key: jax.Array, shape: Sequence[int], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


def zeros_init(key: jax.Array, shape: Sequence[int], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix (A or B): what a LoRA run trains; the base stays frozen."""


class LoRA(nnx.Module):
    """ΔW = scale · A·B beside one projection W of shape [*in, *out] (``in_shape`` contracted
    with the input): A [*in, r], B [r, *out], scale = lora_alpha / r. A ~ N(0, 1/fan_in) and
    B = 0, so the adapted model starts as the base (LoRA, Hu et al. 2021, §4.1: Gaussian A, zero
    B). Stored in float32 whatever the base's dtype (updates of ~lr · |A| would round away in
    bf16); cast to the compute dtype where used, like every weight."""

    def __init__(
        self,
        cfg: ModelConfig,
        in_shape: Sequence[int],
        in_axes: Sequence[str],
        out_shape: Sequence[int],
        out_axes: Sequence[str],
        *,
        key: jax.Array,
    ):
        r = cfg.lora_rank
        self.scale = cfg.lora_alpha / r
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.n_in = len(in_shape)
        a = lora_a_init(key, (*in_shape, r))
        self.a = LoRAParam(a, eager_sharding=False, out_sharding=(*in_axes, "lora_rank"))
        self.b = LoRAParam(
            jnp.zeros((r, *out_shape), jnp.float32),
            eager_sharding=False,
            out_sharding=("lora_rank", *out_axes),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., *in] -> scale · (x·A)·B [..., *out]."""
        c = self.compute_dtype
        k = self.n_in
        xa = jax.lax.dot_general(
            x,
            self.a[...].astype(c),
            ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ())),
        )
        return self.scale * jnp.tensordot(xa, self.b[...].astype(c), axes=1)


def lora_a_init(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """A [*in, r] ~ N(0, 1/fan_in), fan_in = prod(in)."""
    std = np.float32(1.0 / np.sqrt(float(np.prod(shape[:-1]))))
    return jax.random.normal(key, tuple(shape), jnp.float32) * std


def lora_key(cfg: ModelConfig, name: str, layer: int) -> jax.Array:
    """The init key of projection ``name``'s adapter in ``layer``: (model seed, layer, name)."""
    key = jax.random.fold_in(jax.random.key(cfg.seed), _LORA_STREAM)
    return jax.random.fold_in(jax.random.fold_in(key, layer), LORA_TARGETS.index(name))


def lora_initial(cfg: ModelConfig, path: Sequence[object], shape: Sequence[int]) -> jax.Array:
    """The initial value of the adapter matrix at state ``path`` (``(..., "layers", i, module,
    "<proj>_lora", "a" | "b")``) for a model whose base weights come from a checkpoint: the
    draw ``init_model`` makes (equal to f32 round-off: init_model runs it inside its jit)."""
    *_, layer, _, adapter, which = path
    if which == "b":
        return jnp.zeros(tuple(shape), jnp.float32)
    name = str(adapter).removesuffix("_lora") + "_proj"
    return lora_a_init(lora_key(cfg, name, int(layer)), shape)


def lora(
    cfg: ModelConfig,
    name: str,
    layer: int,
    in_shape: Sequence[int],
    in_axes: Sequence[str],
    out_shape: Sequence[int],
    out_axes: Sequence[str],
) -> LoRA | None:
    """The adapter of projection ``name`` of ``layer``, or None when LoRA is off or does not
    target it. Its A comes from a key of its own (model seed, layer, projection), so adapters
    never shift the base weights' random init, and an adapter's init does not depend on which
    others exist."""
    if cfg.lora_rank == 0 or name not in cfg.lora_targets:
        return None
    return LoRA(cfg, in_shape, in_axes, out_shape, out_axes, key=lora_key(cfg, name, layer))


def _plus(y: jax.Array, adapter: LoRA | None, x: jax.Array) -> jax.Array:
    return y if adapter is None else y + adapter(x)


def has_o_bias(cfg: ModelConfig) -> bool:
    """Whether attention has an output-projection bias. HF Llama / Qwen3 ``attention_bias`` adds a
    bias to q, k, v *and* o_proj; Qwen2's built-in bias is on q, k, v only."""
    return cfg.qkv_bias and cfg.arch != "qwen2"


def dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
    """(param dtype, compute dtype)."""
    return jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight over the last axis; the normalization runs in f32."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig, axis_name: str, *, rngs: nnx.Rngs):
        pdtype, self.compute_dtype = dtypes(cfg)
        self.eps = eps
        self.weight = param(rngs, ones_init, (dim,), (axis_name,), pdtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return xf.astype(self.compute_dtype) * self.weight[...].astype(self.compute_dtype)


class Attention(nnx.Module):
    """Grouped-query attention; the attention itself is done by the KV cache backend."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pdtype, self.compute_dtype = dtypes(cfg)
        e, h, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.layer = layer
        self.q_proj = param(rngs, normal_init, (e, h, d), ("embed", "heads", "head_dim"), pdtype)
        self.k_proj = param(
            rngs, normal_init, (e, hkv, d), ("embed", "kv_heads", "head_dim"), pdtype
        )
        self.v_proj = param(
            rngs, normal_init, (e, hkv, d), ("embed", "kv_heads", "head_dim"), pdtype
        )
        self.o_proj = param(rngs, normal_init, (h, d, e), ("heads", "head_dim", "embed"), pdtype)
        if cfg.qkv_bias:
            self.q_bias = param(rngs, zeros_init, (h, d), ("heads", "head_dim"), pdtype)
            self.k_bias = param(rngs, zeros_init, (hkv, d), ("kv_heads", "head_dim"), pdtype)
            self.v_bias = param(rngs, zeros_init, (hkv, d), ("kv_heads", "head_dim"), pdtype)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = param(rngs, zeros_init, (e,), ("embed",), pdtype) if has_o_bias(cfg) else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg, "head_dim", rngs=rngs)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg, "head_dim", rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        kv = ("kv_heads", "head_dim")
        self.q_lora = lora(cfg, "q_proj", layer, (e,), ("embed",), (h, d), ("heads", "head_dim"))
        self.k_lora = lora(cfg, "k_proj", layer, (e,), ("embed",), (hkv, d), kv)
        self.v_lora = lora(cfg, "v_proj", layer, (e,), ("embed",), (hkv, d), kv)
        self.o_lora = lora(cfg, "o_proj", layer, (h, d), ("heads", "head_dim"), (e,), ("embed",))

    def _project(
        self, x: jax.Array, kernel: nnx.Param, bias: nnx.Param | None, adapter: LoRA | None
    ) -> jax.Array:
        y = _plus(
            jnp.einsum("bte,ehd->bthd", x, kernel[...].astype(self.compute_dtype)), adapter, x
        )
        return y if bias is None else y + bias[...].astype(self.compute_dtype)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """x [B, T, E], cos/sin [B, T, D], positions [B, T] -> ([B, T, E], cache)."""
        q = self._project(x, self.q_proj, self.q_bias, self.q_lora)
        k = self._project(x, self.k_proj, self.k_bias, self.k_lora)
        v = self._project(x, self.v_proj, self.v_bias, self.v_lora)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = cache.attend(self.layer, q, k, v, positions)
        # (h, d) contracted in storage order: jnp.einsum emits (d, h), for which XLA:CPU copies
        # o_proj and the attention output transposed on every call.
        w = self.o_proj[...].astype(self.compute_dtype)
        y = _plus(jax.lax.dot_general(out, w, (((2, 3), (0, 1)), ((), ()))), self.o_lora, out)
        if self.o_bias is not None:
            y = y + self.o_bias[...].astype(self.compute_dtype)
        return y, cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        pdtype, self.compute_dtype = dtypes(cfg)
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = param(rngs, normal_init, (e, f), ("embed", "mlp"), pdtype)
        self.up_proj = param(rngs, normal_init, (e, f), ("embed", "mlp"), pdtype)
        self.down_proj = param(rngs, normal_init, (f, e), ("mlp", "embed"), pdtype)
        self.gate_lora = lora(cfg, "gate_proj", layer, (e,), ("embed",), (f,), ("mlp",))
        self.up_lora = lora(cfg, "up_proj", layer, (e,), ("embed",), (f,), ("mlp",))
        self.down_lora = lora(cfg, "down_proj", layer, (f,), ("mlp",), (e,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.compute_dtype
        gate = _plus(x @ self.gate_proj[...].astype(c), self.gate_lora, x)
        up = _plus(x @ self.up_proj[...].astype(c), self.up_lora, x)
        hidden = jax.nn.silu(gate) * up
        return _plus(hidden @ self.down_proj[...].astype(c), self.down_lora, hidden)
