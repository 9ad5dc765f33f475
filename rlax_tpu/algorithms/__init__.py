"""The modular RL objective (RLAX Eq. 3, DESIGN §5) and its named instantiations: pure JAX.

Usage (controller on the host, trainer under jit)::

    objective = make_objective(cfg.algorithm, max_length=cfg.inference.max_new_tokens)
    keep, dropped = objective.filter_groups(rewards_ng)          # [N, G] -> DAPO dynamic sampling
    rewards = objective.shape_rewards(rewards, lengths)          # [B] DAPO overlong shaping
    batch = RolloutBatch(logp_old=..., logp_behaviour=..., mask=..., rewards=...,
                         logp_ref=..., values=...)               # padded [B, T], group-major rows
    objective.validate(batch)                                    # host check, ValueError
    inputs = objective.prepare(batch, step=step)                 # θ-independent, full batch
    loss, metrics = objective.loss(logp, inputs, values=v, entropy=h)   # under jax.grad/jit

``objective.spec`` (ObjectiveSpec) tells the trainer what to compute: ``needs_reference`` (π_ref
log-probs), ``advantage == 'gae'`` (a value head; pass ``values``), ``kind`` and
``needs_groups``. Eq.-3 objectives split rows freely into micro-batches whose losses *sum* to the
full batch's (``prepare`` normalizes the aggregation weights over the full batch). tb and
online_dpo compare the samples of a group inside the loss: their micro-batches must hold whole
groups, and their losses are means over groups/pairs, so average them over equal micro-batches.

Metrics (all stop-gradient scalars): ratio_mean/max (π_θ/π_old), behaviour_logp_diff_mean/p95,
tokens, kl_ref (k3 vs π_ref, when given), entropy (when given); Eq.-3 objectives add
clip_fraction, importance_weight_mean, behaviour_weight_mean, advantage_mean/std/min/max,
policy_loss, and kl_loss / value_loss where used; tb adds tb_log_z_mean, tb_beta; online_dpo
adds dpo_pairs, dpo_margin_mean, dpo_accuracy.

Components, each a small pure function: aggregation.aggregation_weights; importance.token_ratio /
clipped_ratio / truncated_ratio / sequence_ratio / behaviour_weights; advantages.group_normalized
/ group_centered / leave_one_out / whiten / returns_to_go / gae; masks.ppo_clip_mask;
regularizers.kl_estimate (k1/k2/k3); value.clipped_value_loss; tb.tb_beta / vargrad_log_z /
tb_loss; dpo.select_pairs / dpo_loss; shaping.dynamic_sampling_filter / overlong_penalty.
"""

from rlax_tpu.algorithms.batch import LossInputs, RolloutBatch, validate_batch
from rlax_tpu.algorithms.registry import (
    DEFAULTS,
    Objective,
    make_objective,
    register_advantage,
    register_algorithm,
)
from rlax_tpu.algorithms.rewards import RewardInput, register_reward
from rlax_tpu.algorithms.spec import ObjectiveSpec

__all__ = [
    "DEFAULTS",
    "LossInputs",
    "Objective",
    "ObjectiveSpec",
    "RewardInput",
    "RolloutBatch",
    "make_objective",
    "register_advantage",
    "register_algorithm",
    "register_reward",
    "validate_batch",
]
