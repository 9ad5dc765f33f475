"""algorithm.name -> a configured Objective, with each algorithm's paper defaults.

An AlgorithmConfig value of 0 / 'default' means "this algorithm's default" (the tables below).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rlax_tpu.algorithms import objectives, shaping
from rlax_tpu.algorithms.batch import LossInputs, RolloutBatch, validate_batch
from rlax_tpu.algorithms.spec import ObjectiveSpec
from rlax_tpu.algorithms.tb import tb_beta
from rlax_tpu.config import AlgorithmConfig, ConfigError, register_algorithm_name

# Components and hyperparameters per algorithm, from its paper.
DEFAULTS: dict[str, dict[str, Any]] = {
    # DeepSeekMath Eq. 3: PPO clip 0.2, group-normalized A, per-sequence token mean, k3 KL
    # with β = 0.04 (DEFAULT_KL_ESTIMATOR / DEFAULT_KL_COEF).
    "grpo": dict(advantage="group_norm", aggregation="seq_mean_token_mean"),
    # DAPO: clip-higher, token mean, dynamic sampling, soft overlong punishment, no KL.
    "dapo": dict(
        advantage="group_norm",
        aggregation="token_mean",
        eps_high=0.28,
        dynamic_sampling=True,
        overlong_shaping=True,
    ),
    # Dr.GRPO: no std normalization, no length normalization (constant L_max).
    "dr_grpo": dict(advantage="group_center", aggregation="max_length"),
    # GSPO: length-normalized sequence ratio, per-sequence clipping with ε = (3e-4, 4e-4).
    "gspo": dict(
        advantage="group_norm",
        aggregation="seq_mean_token_mean",
        importance="sequence_ratio",
        eps_low=3e-4,
        eps_high=4e-4,
    ),
    # CISPO (MiniMax-M1): sg(clipped ρ) weight, no mask, token mean. The paper sets no lower
    # bound (ε_low = 1) and does not publish its tuned ε_high; 0.28 follows DAPO's clip-higher.
    "cispo": dict(
        advantage="group_norm",
        aggregation="token_mean",
        importance="clipped_ratio",
        clip_mask=False,
        eps_low=1.0,
        eps_high=0.28,
    ),
    # Token-level REINFORCE (RLAX Eq. 9): ω = 1, A = r, w = 1/(G·L_max).
    "reinforce": dict(
        advantage="reward", aggregation="max_length", importance="one", clip_mask=False
    ),
    # RLOO (Kool et al.): REINFORCE with the leave-one-out baseline.
    "rloo": dict(
        advantage="leave_one_out", aggregation="max_length", importance="one", clip_mask=False
    ),
    # REINFORCE++: k1 KL in the token reward, return-to-go, batch-normalized A, PPO clip 0.2.
    "reinforce_pp": dict(
        advantage="batch_norm_kl_reward", aggregation="token_mean", reward_kl_coef=0.01
    ),
    # PPO for LMs (TRL PPOv2 defaults used by Async RLHF): GAE(γ=1, λ=0.95) on a KL-in-reward
    # with β = 0.05, whitened advantages, clip 0.2, clipped value loss with weight 0.1.
    "ppo": dict(advantage="gae", aggregation="token_mean", reward_kl_coef=0.05, value_coef=0.1),
    # AIPO (LlamaRL): ω = min(π_θ/μ, ρ) with ρ in [2, 10] (we take 5), A = r − group mean,
    # Σ_t over tokens (constant normalization).
    "aipo": dict(
        advantage="group_center",
        aggregation="max_length",
        importance="truncated",
        clip_mask=False,
        is_cap=5.0,
    ),
    # SAPO (Qwen): SAPO's soft gate instead of the hard clip, per token, GRPO's aggregation.
    "sapo": dict(
        advantage="group_norm",
        aggregation="seq_mean_token_mean",
        importance="sapo",
        clip_mask=False,
    ),
    # LUSPO: GSPO (sequence ratio and clipping) with each sequence's loss scaled by its length.
    "luspo": dict(
        advantage="group_norm",
        aggregation="seq_mean_token_sum",
        importance="sequence_ratio",
        eps_low=3e-4,
        eps_high=4e-4,
    ),
    # VESPO: a Gamma weight of the sequence ratio (no clip), token mean.
    "vespo": dict(
        advantage="group_norm", aggregation="token_mean", importance="vespo", clip_mask=False
    ),
    "tb": dict(kind="tb", advantage="none"),
    "online_dpo": dict(kind="online_dpo", advantage="none"),
}
# The KL regularizer kl_estimator 'default' picks (DeepSeekMath GRPO: k3); every other
# algorithm's paper has none in the loss (DAPO drops it; PPO / REINFORCE++ put KL in the reward).
DEFAULT_KL_ESTIMATOR = {"grpo": "k3"}
# β of the KL regularizer when one is on and kl_coef is 0 (DeepSeekMath: 0.04).
DEFAULT_KL_COEF = {"grpo": 0.04}
OVERLONG_BUFFER_FRACTION = 5
# algorithm.reward_scaling -> the group-relative advantage estimator
_SCALED = {"group": "group_norm", "batch": "batch_scaled", "none": "group_center"}
_SCALED_FROM = frozenset(_SCALED.values())  # DAPO: a 4096-token buffer in a 20480-token budget


@dataclasses.dataclass(frozen=True)
class Objective:
    """A configured objective. Hashable: close over it (or mark it static) under jax.jit."""

    spec: ObjectiveSpec

    def validate(self, batch: RolloutBatch) -> None:
        """Host-side input check (numpy); raises ValueError naming the bad input."""
        validate_batch(batch, self.spec)

    def prepare(self, batch: RolloutBatch, *, step: int | jax.Array = 0) -> LossInputs:
        """Advantages, aggregation and behaviour weights for the full batch (jit-compatible)."""
        return objectives.prepare(self.spec, batch, step)

    def loss(
        self,
        logp: jax.Array,
        inputs: LossInputs,
        *,
        values: jax.Array | None = None,
        entropy: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) from the current log-probs logp: [B, T] (see objectives.loss)."""
        return objectives.loss(self.spec, logp, inputs, values=values, entropy=entropy)

    def shape_rewards(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rewards [B] plus the overlong penalty for completion lengths [B], if enabled."""
        rewards = np.asarray(rewards, dtype=np.float64)
        if not self.spec.overlong_buffer:
            return rewards
        return rewards + shaping.overlong_penalty(
            lengths,
            max_length=self.spec.max_length,
            buffer=self.spec.overlong_buffer,
            penalty=self.spec.overlong_penalty,
        )

    def filter_groups(self, rewards: np.ndarray) -> tuple[np.ndarray, int]:
        """(keep [N], dropped) for rewards [N, G]: dynamic sampling if enabled, else keep all."""
        if self.spec.dynamic_sampling:
            return shaping.dynamic_sampling_filter(rewards)
        return np.ones(np.asarray(rewards).shape[0], bool), 0

    def beta(self, step: int) -> float:
        """tb/online_dpo temperature at a training step (0 for Eq.-3 objectives)."""
        s = self.spec
        return float(
            tb_beta(step, beta=s.beta, beta_final=s.beta_final, decay_steps=s.beta_decay_steps)
        )


def register_algorithm(name: str, *, base: str = "grpo", **components: Any) -> None:
    """Adds an Eq. 3 algorithm named ``name`` (usable as ``algorithm.name`` once the module
    calling this is in ``algorithm.plugins``): ``base``'s paper defaults with ``components``
    replaced, each an ObjectiveSpec field (advantage, aggregation, importance, clip_mask,
    eps_low, eps_high, kl_estimator, kl_coef, ...) or dynamic_sampling / overlong_shaping. The
    KL regularizer not given is ``base``'s default; config overrides apply as to built-ins."""
    if base not in DEFAULTS or DEFAULTS[base].get("kind", "eq3") != "eq3":
        raise ValueError(f"base {base!r} must be a built-in Eq. 3 algorithm")
    allowed = {f.name for f in dataclasses.fields(ObjectiveSpec)} - {"name", "kind"}
    unknown = sorted(set(components) - allowed - {"dynamic_sampling", "overlong_shaping"})
    if unknown:
        raise ValueError(f"register_algorithm({name!r}): not ObjectiveSpec components: {unknown}")
    advantage = components.get("advantage", DEFAULTS[base].get("advantage"))
    if not objectives.known_advantage(advantage):
        raise ValueError(
            f"register_algorithm({name!r}): unknown advantage {advantage!r}; "
            "register it first with register_advantage"
        )
    register_algorithm_name(name, group=advantage in objectives.GROUP_ESTIMATORS)
    components = dict(components)
    # The KL regularizer's defaults live in their own tables (kl_estimator "default").
    for key, table in (("kl_estimator", DEFAULT_KL_ESTIMATOR), ("kl_coef", DEFAULT_KL_COEF)):
        value = components.pop(key, table.get(base))
        if value is not None:
            table[name] = value
    DEFAULTS[name] = dict(DEFAULTS[base]) | components


def register_advantage(name: str, estimator: Callable[[jax.Array], jax.Array]) -> None:
    """Adds a group advantage estimator: rewards [N, G] -> advantages [N, G] (jittable; each
    row is one prompt's group), usable as ``advantage=name`` in register_algorithm."""
    if objectives.known_advantage(name):
        raise ValueError(f"advantage estimator {name!r} exists already")
    objectives.GROUP_ESTIMATORS[name] = estimator


def make_objective(cfg: AlgorithmConfig, *, max_length: int) -> Objective:
    """The objective for cfg.name with cfg's overrides on its paper defaults.

    max_length: the generation budget L_max (inference.max_new_tokens), used by the max_length
    aggregation and overlong shaping. Raises ConfigError for combinations left unresolvable.
    """
    if max_length < 1:
        raise ConfigError("max_length", "must be >= 1", max_length)
    d = dict(DEFAULTS[cfg.name])
    dynamic = d.pop("dynamic_sampling", False)
    overlong = d.pop("overlong_shaping", False)
    fields: dict[str, Any] = dict(
        name=cfg.name,
        group_size=cfg.group_size,
        max_length=max_length,
        behaviour_correction=cfg.behaviour_correction,
        behaviour_cap=cfg.behaviour_cap,
        behaviour_floor=cfg.behaviour_floor,
        group_std_eps=cfg.group_std_eps,
        gamma=cfg.gamma,
        gae_lambda=cfg.gae_lambda,
        value_clip=cfg.value_clip,
        dynamic_sampling={"on": True, "off": False, "default": dynamic}[cfg.dynamic_sampling],
        overlong_penalty=cfg.overlong_penalty,
        sapo_tau_pos=cfg.sapo_tau_pos,
        sapo_tau_neg=cfg.sapo_tau_neg,
        vespo_k=(cfg.vespo_k_pos, cfg.vespo_k_neg),
        vespo_lambda=(cfg.vespo_lambda_pos, cfg.vespo_lambda_neg),
    )
    fields |= d
    if cfg.reward_scaling != "default":
        if fields.get("advantage") not in _SCALED_FROM:
            raise ConfigError(
                "reward_scaling",
                f"{cfg.name}'s advantage {fields.get('advantage')!r} is not a "
                "group-relative one it can rescale",
                cfg.reward_scaling,
            )
        fields["advantage"] = _SCALED[cfg.reward_scaling]
    if cfg.delta:
        if not fields.get("clip_mask", True) or fields.get("kind", "eq3") != "eq3":
            raise ConfigError(
                "delta", f"caps the PPO-clipped ratio; {cfg.name} has no such clipping", cfg.delta
            )
        fields["delta"] = cfg.delta
    for name in ("eps_low", "eps_high", "is_cap", "reward_kl_coef", "value_coef"):
        if getattr(cfg, name):
            fields[name] = getattr(cfg, name)
    if cfg.aggregation != "default":
        fields["aggregation"] = cfg.aggregation
    estimator = cfg.kl_estimator
    if estimator == "default":
        estimator = DEFAULT_KL_ESTIMATOR.get(cfg.name, "none")
        if estimator == "none" and cfg.kl_coef:
            raise ConfigError(
                "kl_coef",
                f"{cfg.name}'s default has no KL regularizer; set kl_estimator to "
                "k1, k2 or k3 to use kl_coef",
                cfg.kl_coef,
            )
    if estimator != "none":
        if d.get("kind", "eq3") != "eq3":
            raise ConfigError(
                "kl_estimator",
                f"must be 'none': {cfg.name} already measures itself against π_ref",
                cfg.kl_estimator,
            )
        coef = cfg.kl_coef or DEFAULT_KL_COEF.get(cfg.name)
        if not coef:
            raise ConfigError(
                "kl_coef", f"{cfg.name} has no default KL coefficient; set kl_coef", 0.0
            )
        fields |= dict(
            kl_estimator=estimator, kl_coef=coef, kl_bias_correction=cfg.kl_bias_correction
        )
    elif cfg.kl_bias_correction:
        raise ConfigError(
            "kl_bias_correction",
            f"{cfg.name} runs without a KL regularizer here; set kl_estimator (and kl_coef)",
            True,
        )
    if {"on": True, "off": False, "default": overlong}[cfg.overlong_shaping]:
        buffer = cfg.overlong_buffer or max(1, max_length // OVERLONG_BUFFER_FRACTION)
        if buffer > max_length:
            raise ConfigError(
                "overlong_buffer", f"must be <= max_length ({max_length})", cfg.overlong_buffer
            )
        fields["overlong_buffer"] = buffer
    if cfg.name == "tb":
        fields |= dict(
            beta=cfg.tb_beta, beta_final=cfg.tb_beta_final, beta_decay_steps=cfg.tb_beta_decay_steps
        )
    elif cfg.name == "online_dpo":
        fields |= dict(beta=cfg.dpo_beta, beta_final=cfg.dpo_beta)
    return Objective(ObjectiveSpec(**fields))
