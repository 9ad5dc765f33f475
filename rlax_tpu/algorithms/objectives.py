"""prepare (per batch, no θ) and loss (per micro-batch, differentiated) for every ObjectiveSpec.

Eq. 3 as a loss to minimize: L = −Σ w·sg(ω·c·M)·A·log π_θ + β Σ w·R(θ), with c the behaviour
correction. Its gradient is the textbook algorithm's gradient; tests check that per algorithm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import advantages as adv_lib
from rlax_tpu.algorithms.aggregation import aggregation_weights
from rlax_tpu.algorithms.batch import LossInputs, RolloutBatch
from rlax_tpu.algorithms.dpo import dpo_loss
from rlax_tpu.algorithms.importance import (
    behaviour_weights,
    clipped_ratio,
    masked_log_ratio,
    sapo_gate,
    sequence_ratio,
    token_ratio,
    vespo_weight,
)
from rlax_tpu.algorithms.masks import ppo_clip_mask
from rlax_tpu.algorithms.regularizers import kl_estimate
from rlax_tpu.algorithms.spec import ObjectiveSpec
from rlax_tpu.algorithms.tb import tb_beta, tb_loss
from rlax_tpu.algorithms.value import clipped_value_loss

Metrics = dict[str, jax.Array]
_sg = jax.lax.stop_gradient

# Group advantage estimators: rewards [N, G] -> advantages [N, G] (registry.register_advantage
# adds to it).
GROUP_ESTIMATORS = {
    "group_norm": adv_lib.group_normalized,
    "group_center": adv_lib.group_centered,
    "leave_one_out": adv_lib.leave_one_out,
    "batch_scaled": adv_lib.batch_scaled,
}
_OTHER_ADVANTAGES = ("reward", "none", "batch_norm_kl_reward", "gae")


def known_advantage(name: str) -> bool:
    """Whether ``_advantages`` computes the estimator ``name`` (built-in or registered)."""
    return name in GROUP_ESTIMATORS or name in _OTHER_ADVANTAGES


def prepare(spec: ObjectiveSpec, batch: RolloutBatch, step: int | jax.Array = 0) -> LossInputs:
    """The θ-independent parts of the loss, over the full batch (jit-compatible).

    step: the training step, for tb's β schedule.
    """
    dtype = jnp.result_type(batch.logp_old)
    mask = jnp.asarray(batch.mask).astype(dtype)
    rewards = jnp.asarray(batch.rewards).astype(dtype)
    # Padding may hold anything (NaN, -inf); zero it once so no product with the mask can leak it.
    batch = jax.tree.map(lambda x: x if x.ndim != 2 else jnp.where(mask > 0, x, 0.0), batch)
    advantages, returns = _advantages(spec, batch, mask, rewards)
    if spec.kind == "tb":
        beta = tb_beta(
            step, beta=spec.beta, beta_final=spec.beta_final, decay_steps=spec.beta_decay_steps
        )
    else:
        beta = jnp.asarray(spec.beta)
    return LossInputs(
        logp_old=batch.logp_old,
        logp_behaviour=batch.logp_behaviour,
        logp_ref=batch.logp_ref,
        mask=mask,
        rewards=rewards,
        agg_weight=aggregation_weights(mask, spec.aggregation, max_length=spec.max_length),
        advantages=advantages,
        behaviour_weight=behaviour_weights(
            batch.logp_old,
            batch.logp_behaviour,
            mask,
            spec.behaviour_correction,
            spec.behaviour_cap,
            spec.behaviour_floor,
        ),
        values_old=batch.values,
        returns=returns,
        beta=beta.astype(dtype),
    )


def _advantages(spec, batch, mask, rewards):
    kind = spec.advantage
    if kind in GROUP_ESTIMATORS:
        grouped = rewards.reshape(-1, spec.group_size)
        if kind in ("group_norm", "batch_scaled"):
            adv = GROUP_ESTIMATORS[kind](grouped, eps=spec.group_std_eps)
        else:
            adv = GROUP_ESTIMATORS[kind](grouped)
        return adv.reshape(-1, 1) * mask, None
    if kind == "reward":
        return rewards[:, None] * mask, None
    if kind == "none":
        return jnp.zeros_like(mask), None
    kl = None
    if spec.reward_kl_coef:
        kl = masked_log_ratio(batch.logp_old, batch.logp_ref, mask)  # k1 under π_old
    rewards_t = adv_lib.token_rewards(rewards, mask, kl, spec.reward_kl_coef)
    if kind == "batch_norm_kl_reward":
        return adv_lib.whiten(adv_lib.returns_to_go(rewards_t, mask, spec.gamma), mask), None
    if kind == "gae":
        adv, returns = adv_lib.gae(rewards_t, batch.values, mask, spec.gamma, spec.gae_lambda)
        return adv_lib.whiten(adv, mask), returns
    raise ValueError(f"unknown advantage estimator {kind!r}")


def loss(
    spec: ObjectiveSpec,
    logp: jax.Array,
    inputs: LossInputs,
    *,
    values: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """(scalar loss, metrics). logp: [B, T] log π_θ of the sampled tokens (the differentiated
    input); values: [B, T] current value predictions (ppo); entropy: [B, T] token entropies,
    reported if given."""
    mask = inputs.mask
    logp = jnp.where(mask > 0, logp, 0.0)  # padding may hold -inf
    if spec.kind == "eq3":
        out, metrics = _eq3_loss(spec, logp, inputs, values)
    else:
        out, metrics = _sequence_loss(spec, logp, inputs)
    ratio = token_ratio(_sg(logp), inputs.logp_old, mask)
    # |log π_old − log μ|: the trainer/inference numerical mismatch of DESIGN §6.
    mismatch = jnp.abs(masked_log_ratio(inputs.logp_old, inputs.logp_behaviour, mask))
    metrics |= {
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": jnp.where(mask > 0, ratio, 0.0).max(),
        "behaviour_logp_diff_mean": _masked_mean(mismatch, mask),
        "behaviour_logp_diff_p95": jnp.nan_to_num(
            jnp.nanquantile(jnp.where(mask > 0, mismatch, jnp.nan), 0.95)
        ),
        "tokens": mask.sum(),
    }
    if inputs.logp_ref is not None:
        metrics["kl_ref"] = _masked_mean(kl_estimate(_sg(logp), inputs.logp_ref, mask, "k3"), mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, mask)
    return out, metrics


def _eq3_loss(spec, logp, x: LossInputs, values):
    """The surrogate −Σ w·sg(ω·c·M)·A·log π_θ (+ β Σ w·R): its gradient is the algorithm's. The
    metric ``objective`` is the objective's own value, as its paper (and TRL) writes it: the
    clipped min(ωA, clip(ω)A) of PPO-style ratios, SAPO's gated (4/τ)σ(τ(ρ−1))·A; for CISPO,
    AIPO, REINFORCE/RLOO and VESPO, defined by their gradient, it is the surrogate itself."""
    mask, adv = x.mask, x.advantages
    lp = _sg(logp)
    ratio = token_ratio(lp, x.logp_old, mask)
    clip_active = jnp.zeros(mask.shape, bool)
    term = None  # the objective's per-token value J_t (before w and c), where not the surrogate
    if spec.importance == "ratio":
        omega = ratio
    elif spec.importance == "clipped_ratio":
        omega = clipped_ratio(ratio, spec.eps_low, spec.eps_high)
        clip_active = omega != ratio
    elif spec.importance == "truncated":
        to_behaviour = jnp.exp(masked_log_ratio(lp, x.logp_behaviour, mask))
        omega = jnp.minimum(to_behaviour, spec.is_cap)
        clip_active = to_behaviour > spec.is_cap
    elif spec.importance == "sequence_ratio":
        omega = jnp.broadcast_to(sequence_ratio(lp, x.logp_old, mask)[:, None], mask.shape)
    elif spec.importance == "one":
        omega = jnp.ones_like(mask)
    elif spec.importance == "sapo":
        gate, omega = sapo_gate(ratio, adv, spec.sapo_tau_pos, spec.sapo_tau_neg)
        term = gate * adv
    elif spec.importance == "vespo":
        positive = (adv * mask).sum(axis=1) >= 0
        phi = vespo_weight(lp, x.logp_old, mask, positive, spec.vespo_k, spec.vespo_lambda)
        omega = jnp.broadcast_to(phi[:, None], mask.shape)
    else:
        raise ValueError(f"unknown importance weight {spec.importance!r}")
    grad_mask = jnp.ones_like(mask)
    if spec.clip_mask:
        grad_mask = ppo_clip_mask(omega, adv, spec.eps_low, spec.eps_high)
        capped = jnp.minimum(omega, spec.delta) if spec.delta else omega
        clipped = jnp.clip(omega, 1 - spec.eps_low, 1 + spec.eps_high)
        term = jnp.minimum(capped * adv, clipped * adv)
        if spec.delta:  # min(min(ω, δ)·A, clip(ω)·A): a gradient where the active side moves
            inside = (omega > 1 - spec.eps_low) & (omega < 1 + spec.eps_high)
            grad_mask = jnp.where(capped * adv <= clipped * adv, omega < spec.delta, inside)
            grad_mask = grad_mask.astype(mask.dtype)
        clip_active = grad_mask == 0
    coef = _sg(omega * x.behaviour_weight * grad_mask)
    policy_loss = -(x.agg_weight * coef * adv * logp).sum()
    if term is None:
        policy_value = policy_loss
    else:
        policy_value = -(x.agg_weight * x.behaviour_weight * _sg(term)).sum()
    total = policy_loss
    metrics = {
        "policy_loss": _sg(policy_loss),
        "policy_objective": _sg(policy_value),
        "clip_fraction": _masked_mean(clip_active, mask),
        "importance_weight_mean": _masked_mean(omega, mask),
        "behaviour_weight_mean": _masked_mean(x.behaviour_weight, mask),
        **_stats("advantage", adv, mask),
    }
    if spec.kl_estimator != "none":
        kl = kl_estimate(logp, x.logp_ref, mask, spec.kl_estimator)
        if spec.kl_bias_correction:  # differentiated: ∇(ρ·R) = ρ·(R∇log π + ∇R)
            if spec.importance == "sequence_ratio":
                rho = sequence_ratio(logp, x.logp_old, mask)[:, None]
            else:
                rho = token_ratio(logp, x.logp_old, mask)
            kl = kl * rho
        kl_loss = (x.agg_weight * kl).sum()
        total = total + spec.kl_coef * kl_loss
        metrics["kl_loss"] = _sg(kl_loss)
    if spec.value_coef:
        if values is None:
            raise ValueError(f"{spec.name}'s loss needs values=[B, T] value predictions")
        value_loss = clipped_value_loss(
            jnp.where(mask > 0, values, 0.0), x.values_old, x.returns, x.agg_weight, spec.value_clip
        )
        total = total + spec.value_coef * value_loss
        metrics["value_loss"] = _sg(value_loss)
    metrics["objective"] = _sg(total - policy_loss + policy_value)
    return total, metrics


def _sequence_loss(spec, logp, x: LossInputs):
    g = spec.group_size
    seq_logp = (logp * x.mask).sum(axis=1).reshape(-1, g)
    seq_ref = (x.logp_ref * x.mask).sum(axis=1).reshape(-1, g)
    rewards = x.rewards.reshape(-1, g)
    if spec.kind == "tb":
        out, log_z = tb_loss(seq_logp, seq_ref, rewards, x.beta)
        metrics = {"tb_log_z_mean": log_z.mean(), "tb_beta": x.beta}
    else:
        out, metrics = dpo_loss(seq_logp, seq_ref, rewards, x.beta)
    metrics["seq_log_ratio_ref_mean"] = _sg(seq_logp - seq_ref).mean()
    metrics["objective"] = _sg(out)  # these losses are their objectives' values
    return out, metrics


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    x = jnp.where(mask > 0, jnp.asarray(x, mask.dtype), 0.0)
    return x.sum() / jnp.maximum(mask.sum(), 1)


def _stats(prefix: str, x: jax.Array, mask: jax.Array) -> Metrics:
    mean = _masked_mean(x, mask)
    real = mask > 0
    any_real = real.any()
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_std": jnp.sqrt(_masked_mean((x - mean) ** 2, mask)),
        f"{prefix}_min": jnp.where(any_real, jnp.where(real, x, jnp.inf).min(), 0.0),
        f"{prefix}_max": jnp.where(any_real, jnp.where(real, x, -jnp.inf).max(), 0.0),
    }
