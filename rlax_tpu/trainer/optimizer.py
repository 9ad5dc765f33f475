"""The optax optimizer from config: AdamW under a learning-rate schedule, global-norm clipping.

Weight decay applies to matrices only (not to norm scales or biases), as is usual for
transformers. Schedules: ``constant`` (after an optional linear warmup), ``warmup_cosine``
(linear warmup, cosine decay to 0 at ``total_steps``), ``warmup_stable_decay`` (linear warmup,
constant, linear decay to 0 over the last ``decay_steps`` of ``total_steps``).
"""

from __future__ import annotations

import jax
import optax

from rlax_tpu.config import TrainerConfig


def make_schedule(cfg: TrainerConfig, total_steps: int) -> optax.Schedule:
    lr, warmup = cfg.learning_rate, cfg.warmup_steps
    if cfg.schedule == "constant":
        if not warmup:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1), end_value=0.0
        )
    stable = max(0, total_steps - cfg.decay_steps - warmup)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, lr, warmup),
            optax.constant_schedule(lr),
            optax.linear_schedule(lr, 0.0, cfg.decay_steps),
        ],
        [warmup, warmup + stable],
    )


def _matrices(params: optax.Params) -> optax.Params:
    """True for the weight matrices; False for norm scales and biases, whatever their rank (the
    q/k/v biases are stored [heads, head_dim])."""

    def decayed(path: tuple, p: jax.Array) -> bool:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        is_bias = bool(names) and names[-1].endswith("bias")
        return p.ndim >= 2 and not is_bias and not any("norm" in n for n in names)

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: TrainerConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm (unless grad_clip_norm = 0), then AdamW with the schedule."""
    adamw = optax.adamw(
        make_schedule(cfg, total_steps),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=_matrices,
    )
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw
