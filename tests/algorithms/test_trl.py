"""Our losses against Hugging Face TRL 1.16's own code (``GRPOTrainer._compute_loss``, a test-only
dependency): for every loss both projects have, the same batch, advantages and log-probs give the
same objective value (our ``metrics["objective"]``; TRL's returned loss) and the same gradient with
respect to the per-token log-probs, in float64.

TRL's loss runs as written on a bare GRPOTrainer: only what it reads is set (a one-process
accelerator stand-in, the loss options, the policy's per-token log-probs as the model's output).
The advantages are ours, handed to TRL, so the comparison is of the losses alone; the parameter
mapping is the one the README documents (TRL's CISPO caps at epsilon_high = 1 + our eps_high).
"""

from __future__ import annotations

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from rlax_tpu.algorithms import make_objective
from rlax_tpu.config import AlgorithmConfig

G, T = 4, 7


class _OneProcess:
    """accelerate's Accelerator as one process sees it: collectives return their input."""

    num_processes = 1
    is_main_process = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type: str, batch, adv: np.ndarray, logp: np.ndarray, **options):
    """(loss value, d loss / d logp [B, T]) of TRL's _compute_loss."""
    trainer = object.__new__(GRPOTrainer)
    args = dict(
        delta=None,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        use_bias_correction_kl=False,
        steps_per_generation=1,
    )
    args |= {k: options.pop(k) for k in list(options) if k in args}
    fields = (
        dict(
            loss_type=loss_type,
            epsilon_low=0.2,
            epsilon_high=0.2,
            beta=0.0,
            importance_sampling_level="token",
            top_entropy_quantile=1.0,
            off_policy_mask_threshold=None,
            use_vllm=False,
            vllm_importance_sampling_correction=False,
            max_completion_length=T,
            aux_loss_enabled=False,
            _entropy_bonus_enabled=False,
            current_gradient_accumulation_steps=1,
        )
        | options
    )
    for k, v in fields.items():
        setattr(trainer, k, v)
    trainer.args = types.SimpleNamespace(**args)
    trainer.model = types.SimpleNamespace(training=True)
    trainer.accelerator = _OneProcess()
    trainer._metrics = {"train": collections.defaultdict(list)}
    mask = torch.tensor(np.asarray(batch.mask), dtype=torch.float64)
    lp = torch.tensor(np.where(batch.mask > 0, logp, 0.0), dtype=torch.float64, requires_grad=True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, torch.zeros_like(lp), None)
    b = mask.shape[0]
    inputs = {
        "prompt_ids": torch.zeros((b, 1), dtype=torch.long),
        "prompt_mask": torch.ones((b, 1), dtype=torch.long),
        "completion_ids": torch.zeros((b, T), dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(adv, dtype=torch.float64),
        "old_per_token_logps": torch.tensor(np.where(batch.mask > 0, batch.logp_old, 0.0)),
        "ref_per_token_logps": torch.tensor(np.where(batch.mask > 0, batch.logp_ref, 0.0)),
        "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


# (id, our AlgorithmConfig overrides, TRL loss_type, TRL options, logp spread)
CASES = [
    ("grpo", dict(name="grpo", kl_estimator="none"), "grpo", {}, 0.3),
    ("grpo_k3", dict(name="grpo", kl_coef=0.04), "grpo", dict(beta=0.04), 0.3),
    (
        "grpo_k3_bias_corrected",
        dict(name="grpo", kl_coef=0.04, kl_bias_correction=True),
        "grpo",
        dict(beta=0.04, use_bias_correction_kl=True),
        0.3,
    ),
    (
        "grpo_delta",
        dict(name="grpo", kl_estimator="none", delta=1.25),
        "grpo",
        dict(delta=1.25),
        0.3,
    ),
    ("dapo", dict(name="dapo"), "dapo", dict(epsilon_high=0.28), 0.3),
    ("dapo_as_bnpo", dict(name="dapo"), "bnpo", dict(epsilon_high=0.28), 0.3),
    ("dr_grpo", dict(name="dr_grpo"), "dr_grpo", {}, 0.3),
    (
        "gspo",
        dict(name="gspo"),
        "grpo",
        dict(importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
        1e-3,
    ),
    ("cispo", dict(name="cispo", eps_high=0.5), "cispo", dict(epsilon_high=1.5), 0.3),
    ("sapo", dict(name="sapo"), "sapo", {}, 0.3),
    (
        "sapo_tau",
        dict(name="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5),
        "sapo",
        dict(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
        0.3,
    ),
    (
        "luspo",
        dict(name="luspo"),
        "luspo",
        dict(importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
        1e-3,
    ),
    ("vespo", dict(name="vespo"), "vespo", {}, 0.1),
    (
        "vespo_k",
        dict(name="vespo", vespo_k_pos=1.0, vespo_lambda_neg=4.0),
        "vespo",
        dict(vespo_k_pos=1.0, vespo_lambda_neg=4.0),
        0.1,
    ),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_value_and_gradient_equal_trls(case, seed, x64, make_batch):
    _, overrides, loss_type, options, spread = case
    batch, logp, _ = make_batch(seed, group_size=G, length=T, spread=spread)
    batch = dataclasses.replace(batch, logp_behaviour=batch.logp_old)  # TRL has no μ ≠ π_old here
    obj = make_objective(AlgorithmConfig(group_size=G, **overrides), max_length=T)
    inputs = obj.prepare(batch)
    mask = np.asarray(batch.mask)
    adv = (np.asarray(inputs.advantages) * mask).sum(axis=1) / mask.sum(axis=1)  # one per row

    (_, metrics), ours = jax.value_and_grad(lambda lp: obj.loss(lp, inputs), has_aux=True)(
        jnp.asarray(logp)
    )
    value, theirs = trl_loss(loss_type, batch, adv, logp, **options)

    real = mask > 0
    # TRL builds SAPO's temperatures in float32 (torch.where of Python floats): τ = 1.05 is off
    # by 5e-8 there, which the group's cancelling sum of (4/τ)σ·A shows at ~1e-6 of the value.
    tol = 1e-5 if loss_type == "sapo" else 1e-10
    np.testing.assert_allclose(float(metrics["objective"]), value, rtol=tol, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ours)[real], theirs[real], rtol=tol, atol=1e-12)
    assert np.abs(theirs).max() > 1e-3  # not vacuous
