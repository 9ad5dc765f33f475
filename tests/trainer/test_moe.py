"""A mixture-of-experts model in the trainer: it trains, and the load-balancing term is in the
loss and its metric."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from rlax_tpu import models
from rlax_tpu.config import ConfigError
from rlax_tpu.trainer import Trainer

from .helpers import host, random_batch, run_config


def test_a_moe_model_trains_with_the_load_balancing_term(tmp_path):
    model = models.preset(
        "tiny", arch="qwen3_moe", qk_norm=True, num_layers=2, num_experts=4, experts_per_token=2
    )
    cfg = run_config(model=model)
    cfg = dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, router_aux_loss_coef=0.01)
    )
    trainer = Trainer(cfg, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    before = host(trainer.params())
    metrics = trainer.train_step(random_batch(1))
    after = host(trainer.params())
    trainer.close()
    # At init the router's softmax is near uniform (weights ~ N(0, 0.02²)): X·Σ f·P ≈ X·k·(1/X)
    # = k, the term's value for perfectly balanced routing.
    assert abs(metrics["router_aux_loss"] - 2.0) < 0.1
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), after, before)
    assert all(jax.tree.leaves(moved["layers"][0]["mlp"]))  # router and every expert weight


def test_the_term_needs_experts():
    cfg = run_config()
    with pytest.raises(ConfigError, match="router_aux_loss_coef.*has no experts"):
        dataclasses.replace(
            cfg, algorithm=dataclasses.replace(cfg.algorithm, router_aux_loss_coef=0.01)
        )
