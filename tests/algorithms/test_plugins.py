"""The open registry: an algorithm and an advantage estimator of the user's own, registered by a
plugin module the config names, reach the objective; bad plugins and names are refused clearly."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.algorithms import RolloutBatch, make_objective, register_algorithm
from rlax_tpu.config import AlgorithmConfig, ConfigError

PLUGIN = "tests.algorithms.plugin_rank"


def test_a_plugin_algorithm_from_the_config():
    cfg = AlgorithmConfig(name="rank_grpo", group_size=4, plugins=(PLUGIN,))
    obj = make_objective(cfg, max_length=3)
    assert obj.spec.advantage == "centered_rank" and obj.spec.kl_estimator == "none"
    assert obj.spec.eps_low == 0.2 and obj.spec.aggregation == "seq_mean_token_mean"  # grpo's
    rewards = jnp.asarray([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 2.0, 2.0], jnp.float32)
    mask = jnp.ones((8, 3), jnp.float32)
    batch = RolloutBatch(
        logp_old=-mask, logp_behaviour=-mask, mask=mask, rewards=rewards, logp_ref=None, values=None
    )
    adv = np.asarray(obj.prepare(batch).advantages)[:, 0]
    # ranks 0, 1.5, 1.5, 3 of 3 -> -0.5, 0, 0, 0.5; an all-equal group -> 0.
    np.testing.assert_allclose(adv, [-0.5, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    # Overrides apply as to built-ins.
    assert (
        make_objective(
            AlgorithmConfig(name="rank_grpo", eps_high=0.3, plugins=(PLUGIN,)), max_length=3
        ).spec.eps_high
        == 0.3
    )


def test_bad_plugins_and_registrations_are_refused():
    with pytest.raises(ConfigError, match=r"plugins.*cannot import 'no_such_module'"):
        AlgorithmConfig(name="grpo", plugins=("no_such_module",))
    with pytest.raises(ConfigError, match="name the module that registers it in algorithm.plugins"):
        AlgorithmConfig(name="my_own_rl")
    with pytest.raises(ValueError, match="built-in"):
        register_algorithm("grpo", advantage="group_norm")
    with pytest.raises(ValueError, match="unknown advantage 'nope'"):
        register_algorithm("other", advantage="nope")
    with pytest.raises(ValueError, match="not ObjectiveSpec components"):
        register_algorithm("other", learning_rate=1.0)
    with pytest.raises(ValueError, match="Eq. 3"):
        register_algorithm("other", base="tb")
