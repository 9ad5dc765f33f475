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
log-probs), ``advantage == 'gae'`` (a value head; pass ``values``), ``needs_groups`` (tb and
online_dpo micro-batches must hold whole groups; every other objective splits rows freely, since
``prepare`` normalizes the aggregation weights over the full batch).

Components, each a small pure function: aggregation.aggregation_weights; importance.token_ratio /
clipped_ratio / truncated_ratio / sequence_ratio / behaviour_weights; advantages.group_normalized
/ group_centered / leave_one_out / whiten / returns_to_go / gae; masks.ppo_clip_mask;
regularizers.kl_estimate (k1/k2/k3); value.clipped_value_loss; tb.tb_beta / vargrad_log_z /
tb_loss; dpo.select_pairs / dpo_loss; shaping.dynamic_sampling_filter / overlong_penalty.
"""

from rlax_tpu.algorithms.batch import LossInputs, RolloutBatch, validate_batch
from rlax_tpu.algorithms.registry import DEFAULTS, Objective, make_objective
from rlax_tpu.algorithms.spec import ObjectiveSpec

__all__ = [
    "DEFAULTS",
    "LossInputs",
    "Objective",
    "ObjectiveSpec",
    "RolloutBatch",
    "make_objective",
    "validate_batch",
]
