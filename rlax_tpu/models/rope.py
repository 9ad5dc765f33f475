"""Rotary position embeddings (half-rotation layout, as HF checkpoints store Q/K) and their scalings.

Scalings, with the formulas of their papers / reference implementations:
  linear   positions divided by ``factor`` (inverse frequencies / factor).
  dynamic  NTK-aware: the base grows with the longest position seen in the batch beyond
           ``max_position_embeddings``; shorter batches use the plain base. As in HF, the base
           depends on the positions of the *current call*: past max_position_embeddings a cached
           ``step`` (keys rotated with the base of the step that wrote them) and the full
           ``forward`` (every key with the base of the longest position) give different logits,
           and so do two batches of different lengths. Use it only within max_position_embeddings
           when decoding must match scoring (RL old-policy recompute), or prefer yarn / llama3.
  llama3   low frequencies / factor, high frequencies kept, a smooth ramp in between.
  yarn     per-frequency blend of interpolation and extrapolation, cos/sin scaled by an
           attention factor.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tpu.config import ModelConfig


def _base_inv_freq(base: float | jax.Array, dim: int) -> jax.Array:
    return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _llama3_inv_freq(cfg: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
    factor, old_len = cfg.rope_scaling_factor, cfg.resolved_rope_original_max_position_embeddings
    low_wavelen = old_len / cfg.rope_low_freq_factor
    high_wavelen = old_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def yarn_attention_factor(cfg: ModelConfig) -> float:
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_scaling_factor) + 1.0 if cfg.rope_scaling_factor > 1 else 1.0


def _yarn_inv_freq(cfg: ModelConfig, dim: int) -> np.ndarray:
    base, factor = cfg.rope_theta, cfg.rope_scaling_factor
    old_len = cfg.resolved_rope_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    interpolation = extrapolation / factor
    keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


def inverse_frequencies(cfg: ModelConfig, positions: jax.Array) -> jax.Array:
    """Inverse frequencies [head_dim // 2] (f32) for a batch with ``positions`` [B, T]."""
    dim = cfg.resolved_head_dim
    kind = cfg.rope_scaling
    if kind == "dynamic":
        # Call-dependent base (see the module docstring): step and forward differ past max_pos.
        longest = jnp.maximum(jnp.max(positions) + 1, cfg.max_position_embeddings)
        factor = cfg.rope_scaling_factor
        grow = (factor * longest / cfg.max_position_embeddings - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(cfg.rope_theta * grow.astype(jnp.float32), dim)
    if kind == "llama3":
        plain = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
        return jnp.asarray(_llama3_inv_freq(cfg, plain), jnp.float32)
    if kind == "yarn":
        return jnp.asarray(_yarn_inv_freq(cfg, dim), jnp.float32)
    inv_freq = _base_inv_freq(cfg.rope_theta, dim)
    return inv_freq / cfg.rope_scaling_factor if kind == "linear" else inv_freq


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables [B, T, head_dim] (f32) for integer ``positions`` [B, T]."""
    inv_freq = inverse_frequencies(cfg, positions)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = yarn_attention_factor(cfg)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [B, T, H, D] by the tables [B, T, D]; math in f32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
