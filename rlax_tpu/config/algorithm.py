"""The algorithm section: the objective, its names and the plugins that add more."""

from __future__ import annotations

import difflib
import importlib
from typing import Literal

from rlax_tpu.config.checks import bad, frozen, in_range, non_negative, positive

ALGORITHMS = (
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "cispo",
    "reinforce",
    "rloo",
    "reinforce_pp",
    "ppo",
    "aipo",
    "tb",
    "online_dpo",
    "sapo",
    "luspo",
    "vespo",
)
# Algorithms whose advantage or loss is defined over a group of samples of one prompt.
GROUP_ALGORITHMS = frozenset(
    {
        "grpo",
        "dapo",
        "dr_grpo",
        "gspo",
        "cispo",
        "rloo",
        "tb",
        "online_dpo",
        "sapo",
        "luspo",
        "vespo",
    }
)
# Algorithms user code registered (rlax_tpu.algorithms.register_algorithm): name -> whether it is
# defined over a group. A config names the modules that register them in algorithm.plugins.
_REGISTERED_ALGORITHMS: dict[str, bool] = {}


def register_algorithm_name(name: str, *, group: bool) -> None:
    """Makes ``name`` a valid algorithm.name (called by algorithms.register_algorithm)."""
    if name in ALGORITHMS:
        raise ValueError(f"{name!r} is a built-in algorithm; register another name")
    _REGISTERED_ALGORITHMS[name] = group


def known_algorithms() -> tuple[str, ...]:
    return (*ALGORITHMS, *_REGISTERED_ALGORITHMS)


REWARDS = ("verdict", "partial")
_REGISTERED_REWARDS: list[str] = []


def register_reward_name(name: str) -> None:
    """Makes ``name`` a valid algorithm.reward (called by algorithms.register_reward)."""
    if name in REWARDS:
        raise ValueError(f"{name!r} is a built-in reward function; register another name")
    _REGISTERED_REWARDS.append(name)


def known_rewards() -> tuple[str, ...]:
    return (*REWARDS, *_REGISTERED_REWARDS)


@frozen
class AlgorithmConfig:
    """The objective (DESIGN §5). Zero/empty values mean "the named algorithm's paper default"."""

    name: str = "grpo"  # the objective: a built-in (docs/configuration.md) or a registered plugin's
    group_size: int = 8  # G samples per prompt
    eps_low: float = 0.0  # PPO-style clip 1 - ε_low; 0 = algorithm default
    eps_high: float = 0.0  # clip 1 + ε_high; 0 = algorithm default
    # Regularizer β·R: 'default' = the algorithm's paper default (grpo: k3 with β 0.04; dapo and
    # most others: off), 'none' turns it off; with an estimator, kl_coef 0 = algorithm default β.
    kl_coef: float = 0.0
    # The KL estimator of kl_coef's regularizer (see above).
    kl_estimator: Literal["default", "none", "k1", "k2", "k3"] = "default"
    # The KL regularizer times the importance ratio ρ = π_θ/π_old (differentiated): an unbiased
    # estimate of KL(π_θ‖π_ref) from π_old's samples (TRL's use_bias_correction_kl).
    kl_bias_correction: bool = False
    # Two-sided clipping (INTELLECT-2; TRL's delta): no gradient where the ratio exceeds delta,
    # whatever the advantage's sign; > 1 (e.g. 4). 0: off. PPO-clipped algorithms only.
    delta: float = 0.0
    # Advantage scaling of group-relative algorithms: "group" (r − mean)/(group std + eps),
    # "batch" (r − group mean)/(batch std + eps) (PPO Lite; TRL's scale_rewards="batch"),
    # "none" r − group mean (Dr.GRPO); "default": the algorithm's own.
    reward_scaling: Literal["default", "group", "batch", "none"] = "default"
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature τ for tokens with A > 0
    sapo_tau_neg: float = 1.05  # SAPO's gate temperature τ for tokens with A <= 0
    # VESPO's Gamma weight φ(w) = e^λ·w^k·e^(−λw) of the sequence ratio w, per advantage sign.
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0  # VESPO's decay λ for A >= 0
    vespo_k_neg: float = 3.0  # VESPO's exponent k for A < 0
    vespo_lambda_neg: float = 2.0  # VESPO's decay λ for A < 0
    reward_kl_coef: float = 0.0  # KL folded into the reward (ppo, reinforce_pp); 0 = default
    # Mixture of experts: weight of the load-balancing loss (Switch Transformer, over the batch's
    # tokens and every layer) added to the objective; 0 = off (pretraining used ~0.001).
    router_aux_loss_coef: float = 0.0
    # Token weights: per-sequence mean, token mean, or 1/(B·L_max).
    aggregation: Literal["default", "seq_mean_token_mean", "token_mean", "max_length"] = "default"
    is_cap: float = 0.0  # AIPO truncation c; 0 = algorithm default
    # reweight by c = π_old/μ per token or sequence
    behaviour_correction: Literal[
        "none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"
    ] = "none"
    behaviour_cap: float = 2.0  # upper bound on c (truncate or mask)
    # *_mask only: keep c = π_old/μ inside [behaviour_floor, behaviour_cap] (IcePop's two-sided
    # band, e.g. 0.5 and 2); 0 = one-sided. seq_* modes use the length-normalized (geometric) c.
    behaviour_floor: float = 0.0
    # group_norm advantages (r - mean) / (std + group_std_eps): verl's 1e-6; TRL adds 1e-4. It
    # decides how far a group with nearly equal rewards is blown up.
    group_std_eps: float = 1e-6
    # DAPO: drop groups with equal rewards, refill the batch.
    dynamic_sampling: Literal["default", "on", "off"] = "default"
    overlong_shaping: Literal["default", "on", "off"] = "default"  # DAPO soft overlong punishment
    overlong_buffer: int = 0  # its length L_cache; 0 = max_new_tokens // 5 (DAPO's 4096 of 20480)
    overlong_penalty: float = 1.0  # reward at and beyond max_new_tokens
    gamma: float = 1.0  # PPO GAE discount γ
    gae_lambda: float = 0.95  # PPO GAE λ (bias-variance trade-off)
    value_clip: float = 0.2  # PPO value clipping range
    value_coef: float = 0.0  # PPO value-loss weight; 0 = algorithm default
    # TB's β decays linearly from tb_beta to tb_beta_final over tb_beta_decay_steps (0: constant).
    tb_beta: float = 0.012
    tb_beta_final: float = 0.004  # TB's β after the decay
    tb_beta_decay_steps: int = 500  # updates over which β decays; 0: constant
    dpo_beta: float = 0.1  # online DPO's β
    # Python modules imported before algorithm.name is checked, so that they can register
    # algorithms, advantage estimators and reward functions (rlax_tpu.algorithms.
    # register_algorithm / register_advantage / register_reward); every process that builds the
    # objective imports them.
    plugins: tuple[str, ...] = ()
    # The reward of a rollout from its verdict: "verdict" (1 accepted, else 0), "partial" (the
    # fraction of tests passed), or a function registered by a plugin. Evaluation's pass@1
    # counts accepted answers whatever the reward.
    reward: str = "verdict"

    def __post_init__(self) -> None:
        for module in self.plugins:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any failure of user code, named
                raise bad(
                    self, "plugins", f"cannot import {module!r}: {type(e).__name__}: {e}"
                ) from None
        known = known_algorithms()
        if self.name not in known:
            close = difflib.get_close_matches(self.name, known, n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; built-in: {', '.join(ALGORITHMS)} (an algorithm of your own: name the "
                "module that registers it in algorithm.plugins)"
            )
            raise bad(self, "name", f"unknown algorithm{hint}")
        if self.reward not in known_rewards():
            raise bad(
                self,
                "reward",
                f"unknown reward function; built-in: {', '.join(REWARDS)} "
                "(one of your own: name the module that registers it in "
                "algorithm.plugins)",
            )
        positive(
            self,
            "group_size",
            "behaviour_cap",
            "overlong_penalty",
            "tb_beta",
            "tb_beta_final",
            "dpo_beta",
        )
        in_range(self, "eps_low", 0.0, 1.0, hi_open=True)
        non_negative(self, "eps_high", "kl_coef", "is_cap", "overlong_buffer", "value_clip")
        non_negative(self, "reward_kl_coef", "value_coef", "tb_beta_decay_steps")
        non_negative(self, "router_aux_loss_coef")
        positive(
            self,
            "group_std_eps",
            "sapo_tau_pos",
            "sapo_tau_neg",
            "vespo_lambda_pos",
            "vespo_lambda_neg",
        )
        non_negative(self, "vespo_k_pos", "vespo_k_neg", "delta")
        if self.delta and self.delta <= 1.0:
            raise bad(self, "delta", "caps the ratio from above: must be > 1 (or 0: off)")
        in_range(self, "gamma", 0.0, 1.0)
        in_range(self, "gae_lambda", 0.0, 1.0)
        if self.kl_coef > 0 and self.kl_estimator == "none":
            raise bad(
                self, "kl_estimator", f"is 'none' but kl_coef is {self.kl_coef}; pick k1, k2 or k3"
            )
        grouped = self.name in GROUP_ALGORITHMS or _REGISTERED_ALGORITHMS.get(self.name, False)
        if (grouped or self.name == "aipo") and self.group_size < 2:
            raise bad(
                self, "group_size", f"{self.name} compares samples within a group: needs >= 2"
            )
        if self.is_cap and self.name != "aipo":
            raise bad(self, "is_cap", f"only aipo truncates at a cap; {self.name} has none")
        if self.reward_kl_coef and self.name not in ("ppo", "reinforce_pp"):
            raise bad(
                self, "reward_kl_coef", "only ppo and reinforce_pp fold a KL term into the reward"
            )
        if self.behaviour_correction != "none" and self.name in ("aipo", "tb", "online_dpo"):
            why = {
                "aipo": "aipo's truncated weight min(π/μ, c) already corrects for μ",
                "tb": "tb is off-policy by construction and uses no importance weight",
                "online_dpo": "online_dpo uses no importance weight",
            }[self.name]
            raise bad(self, "behaviour_correction", f"must be 'none': {why}")
        if self.behaviour_floor and not self.behaviour_correction.endswith("_mask"):
            raise bad(
                self,
                "behaviour_floor",
                "is the lower edge of a mask band: needs "
                f"behaviour_correction token_mask or seq_mask, not "
                f"{self.behaviour_correction!r}",
            )
        if not 0.0 <= self.behaviour_floor < self.behaviour_cap:
            raise bad(
                self, "behaviour_floor", f"must be in [0, behaviour_cap = {self.behaviour_cap})"
            )
