"""Objectives that need more than the policy: PPO's value head and a KL term against the frozen
reference model (same shardings, no optimizer state)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rlax_tpu.trainer import Trainer

from .helpers import host, random_batch, run_config


def test_ppo_value_head_and_grpo_kl_reference(tmp_path):
    cfg = run_config((1, 2, 1), algorithm="ppo")
    ppo = Trainer(cfg, devices=jax.devices()[:2], checkpoint_dir=tmp_path / "ppo")
    head = host(ppo._trainable["value_head"])
    m = ppo.train_step(random_batch(0))
    assert np.isfinite(m["value_loss"]) and m["value_loss"] > 0
    # The value head was trained (it starts at 0).
    assert np.abs(host(ppo._trainable["value_head"])["w"] - head["w"]).max() > 0
    ppo.close()

    cfg = run_config((1, 2, 1))
    cfg = dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, kl_estimator="k3", kl_coef=0.1)
    )
    grpo = Trainer(cfg, devices=jax.devices()[:2], checkpoint_dir=tmp_path / "kl")
    ref_before = host(grpo._ref_params)
    first = grpo.train_step(random_batch(0))
    assert first["kl_ref"] == 0.0  # π_θ = π_ref before the first update
    second = grpo.train_step(random_batch(1))
    assert second["kl_ref"] > 0.0
    # The reference is frozen, sharded like the policy, and has no optimizer state.
    jax.tree.map(np.testing.assert_array_equal, host(grpo._ref_params), ref_before)
    assert grpo._ref_params["embed"].sharding == grpo.params()["embed"].sharding
    grpo.close()
