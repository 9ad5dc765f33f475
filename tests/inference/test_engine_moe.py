"""A mixture-of-experts model in the engine: its log-probs are the trainer's replay (bitwise
where the engine's start-up check finds rows independent) and its greedy tokens the uncached
forward's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu import models

from .conftest import make_engine, random_requests
from .test_engine import _run_checked, assert_greedy, assert_the_replay


@pytest.fixture(scope="module")
def moe_model() -> models.Transformer:
    cfg = models.preset(
        "tiny", arch="qwen3_moe", qk_norm=True, num_experts=4, expert_intermediate_size=96
    )
    return models.init_model(cfg)


def test_logprobs_are_the_replay_and_greedy_tokens_the_forwards(moe_model):
    engine = make_engine(moe_model, prefill_rows=2, prefill_len=3)
    for r in random_requests(4, num_samples=2, temperature=0.8):
        engine.submit(r)
    assert_the_replay(moe_model, engine, _run_checked(engine), temperature=0.8)

    greedy = make_engine(moe_model)
    for r in random_requests(3, seed=1, temperature=0.0):
        greedy.submit(r)
    forward = jax.jit(models.forward)
    for ro in _run_checked(greedy):
        p, n = len(ro.prompt_tokens), len(ro.tokens)
        seq = np.zeros((1, 48), np.int32)
        seq[0, : p + n] = [*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]
        logits = forward(moe_model, jnp.asarray(seq))[0, p - 1 : p + n - 1]
        assert_greedy(ro.tokens, np.asarray(logits), tol=1e-5)
