"""ObjectiveSpec: one algorithm's components and hyperparameters, fully resolved (no defaults left)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlax_tpu.algorithms.aggregation import Aggregation
from rlax_tpu.algorithms.importance import BehaviourCorrection

Kind = Literal["eq3", "tb", "online_dpo"]
Advantage = Literal[
    "group_norm",
    "group_center",
    "leave_one_out",
    "batch_scaled",
    "reward",
    "batch_norm_kl_reward",
    "gae",
    "none",
]
Importance = Literal[
    "ratio", "clipped_ratio", "truncated", "sequence_ratio", "one", "sapo", "vespo"
]
GROUP_ADVANTAGES = ("group_norm", "group_center", "leave_one_out", "batch_scaled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveSpec:
    """Hashable, so an Objective can close over it inside jax.jit as static configuration.

    kind 'eq3' is RLAX Eq. 3 with: aggregation (w), importance (ω: 'ratio' ρ = π_θ/π_old,
    'clipped_ratio' CISPO, 'truncated' AIPO min(π_θ/μ, is_cap), 'sequence_ratio' GSPO, 'one',
    'sapo' SAPO's soft gate, 'vespo' VESPO's Gamma weight), clip_mask (M: PPO clipping with
    eps_low/eps_high, per sequence for GSPO; ``delta`` also caps ω from above, two-sided),
    advantage (A), kl_estimator/kl_coef (β·R; ``kl_bias_correction`` weighs R by ω).
    'tb' and 'online_dpo' are the two objectives beside Eq. 3.
    """

    name: str
    kind: Kind = "eq3"
    group_size: int
    max_length: int  # L_max, the generation budget (max_new_tokens)
    aggregation: Aggregation = "seq_mean_token_mean"
    advantage: Advantage = "group_norm"
    importance: Importance = "ratio"
    clip_mask: bool = True
    eps_low: float = 0.2
    eps_high: float = 0.2
    is_cap: float = 0.0
    kl_estimator: Literal["none", "k1", "k2", "k3"] = "none"
    kl_coef: float = 0.0
    kl_bias_correction: bool = False  # R·ρ: the KL estimated under π_old's samples (TRL)
    delta: float = 0.0  # two-sided clipping: no gradient where ω > delta (INTELLECT-2); 0: off
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # ... for A <= 0
    vespo_k: tuple[float, float] = (2.0, 3.0)  # VESPO exponent k for A >= 0, A < 0
    vespo_lambda: tuple[float, float] = (3.0, 2.0)  # VESPO decay λ for A >= 0, A < 0
    reward_kl_coef: float = 0.0  # β of the per-token KL folded into the reward (ppo, reinforce_pp)
    behaviour_correction: BehaviourCorrection = "none"
    behaviour_cap: float = 2.0
    behaviour_floor: float = 0.0  # *_mask: lower edge of the kept band (IcePop)
    group_std_eps: float = 1e-6  # group_norm: (r - mean) / (std + eps)
    gamma: float = 1.0
    gae_lambda: float = 0.95
    value_clip: float = 0.2
    value_coef: float = 0.0
    beta: float = 0.0  # tb / online_dpo temperature (tb: initial value of its schedule)
    beta_final: float = 0.0
    beta_decay_steps: int = 0
    dynamic_sampling: bool = False
    overlong_buffer: int = 0  # 0: no overlong shaping
    overlong_penalty: float = 1.0

    @property
    def needs_groups(self) -> bool:
        """Whether the objective compares the samples of a group (G >= 2, whole groups)."""
        return self.kind != "eq3" or self.advantage in GROUP_ADVANTAGES

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute log π_ref."""
        return self.kind != "eq3" or self.kl_estimator != "none" or self.reward_kl_coef > 0

    @property
    def required_inputs(self) -> tuple[str, ...]:
        """RolloutBatch fields (besides the always-present ones) this objective reads."""
        out = ("logp_ref",) if self.needs_reference else ()
        return out + (("values",) if self.advantage == "gae" else ())
