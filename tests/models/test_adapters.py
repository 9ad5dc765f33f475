"""Splitting a model's parameters into adapters and base, and joining them back."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from rlax_tpu import models
from rlax_tpu.models.adapters import join, split_adapters
from rlax_tpu.models.checkpoint import abstract_model
from rlax_tpu.models.layers import LoRAParam


def test_split_puts_exactly_the_lora_params_on_the_adapter_side_and_join_inverts_it():
    cfg = dataclasses.replace(models.preset("tiny"), num_layers=2, lora_rank=2)
    state = nnx.state(models.init_model(cfg))
    params = nnx.to_pure_dict(state)
    adapters, base = split_adapters(params)
    want = nnx.to_pure_dict(nnx.state(models.init_model(cfg), LoRAParam))
    assert jax.tree.structure(adapters) == jax.tree.structure(want)
    assert len(jax.tree.leaves(base)) + len(jax.tree.leaves(adapters)) == len(
        jax.tree.leaves(params)
    )
    joined = join(base, adapters)
    assert jax.tree.structure(joined) == jax.tree.structure(params)
    assert all(
        a is b for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(params), strict=True)
    )
    plain = nnx.to_pure_dict(nnx.state(models.init_model(dataclasses.replace(cfg, lora_rank=0))))
    assert jax.tree.structure(base) == jax.tree.structure(plain)
    np.testing.assert_array_equal(base["embed"], plain["embed"])


def test_the_configs_parameter_counts_equal_the_models_trees():
    """ModelConfig.param_count / adapter_count (the planner's and the GKE sizing's arithmetic)
    against the leaves of an initialized model, for each family's biases and norms."""
    for arch, extra in (
        ("llama", {}),
        ("qwen2", {"qkv_bias": True, "tie_embeddings": False}),
        ("qwen3", {"qk_norm": True}),
        ("llama", {"qkv_bias": True}),  # HF attention_bias: o_proj's bias too
    ):
        cfg = dataclasses.replace(
            models.preset("tiny"),
            arch=arch,
            num_layers=2,
            lora_rank=3,
            lora_targets=("q_proj", "v_proj", "down_proj"),
            **extra,
        )
        # Shapes only (nothing compiled or allocated): the tree init_model would make.
        adapters, base = split_adapters(nnx.to_pure_dict(nnx.state(abstract_model(cfg))))
        assert sum(x.size for x in jax.tree.leaves(base)) == cfg.param_count(), arch
        assert sum(x.size for x in jax.tree.leaves(adapters)) == cfg.adapter_count(), arch
