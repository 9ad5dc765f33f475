"""A multi-turn episode's environment tokens carry no gradient.

The trainer's first update on a batch whose ``loss_mask`` zeroes an environment span inside
each completion is the one a textbook GRPO loss (DeepSeekMath Eq. 3, written here one sequence
at a time from a plain forward) predicts when it sums over the model's tokens alone, and not the
one it predicts over every token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.models.transformer import forward
from rlax_tpu.trainer import Trainer

from .helpers import GROUP, host, random_batch, run_config

LR, EPS = 1e-3, 1e-3  # AdamW's first step is -LR·g/(|g| + EPS): smooth in g at this EPS


def _environment_mask(batch):
    """1 on the model's tokens; 0 on the middle third of each completion of 3+ tokens."""
    mask = np.zeros(batch.behaviour_logprobs.shape, np.float32)
    for i, c in enumerate(batch.completion_lengths):
        mask[i, :c] = 1.0
        if c >= 3:
            mask[i, c // 3 : 2 * c // 3] = 0.0
    return mask


def _textbook_grad(graphdef, batch):
    """(params, mask M) -> ∇ of −1/B Σ_i 1/|M_i| Σ_{t ∈ M_i} min(ρA_i, clip(ρ)A_i) at π_θ = π_old
    (ρ = 1), one sequence at a time: each row's forward alone, its terms weighted by position
    (an argument, so one program serves every row and mask; the rows' lengths unrolled in one
    program took 9 s to compile). The forward runs over the row's whole stored width: it is
    causal, so the tokens after a completion change none of its log-probs."""
    r = np.asarray(batch.rewards, np.float64)
    adv = np.empty_like(r)
    for s in range(0, len(r), GROUP):
        grp = r[s : s + GROUP]
        adv[s : s + GROUP] = (grp - grp.mean()) / (np.std(grp, ddof=1) + 1e-6)

    def row_loss(p, row, weights):
        """row [1, W] tokens; weights [W - 1]: the term of the log-prob of token t + 1."""
        model = nnx.merge(graphdef, p)
        logits = forward(model, row)[0, :-1]
        lp = jnp.take_along_axis(
            jax.nn.log_softmax(logits / batch.temperature), row[0, 1:, None], axis=-1
        )[:, 0]
        ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))  # 1, inside any clip range
        return -jnp.sum(ratio * weights)

    grad = jax.jit(jax.grad(row_loss))

    def textbook(params, mask):
        total = None
        for i in range(batch.num_rows):
            prompt, c = int(batch.prompt_lengths[i]), int(batch.completion_lengths[i])
            m = np.asarray(mask[i, :c], np.float64)
            weights = np.zeros(batch.tokens.shape[1] - 1, np.float32)
            weights[prompt - 1 : prompt + c - 1] = adv[i] * m / m.sum() / batch.num_rows
            row = jnp.asarray(batch.tokens[i : i + 1])
            g = host(grad(params, row, jnp.asarray(weights)))
            total = g if total is None else jax.tree.map(np.add, total, g)
        return total

    return textbook


def _adam_first_step(grad):
    return jax.tree.map(lambda g: -LR * g / (np.abs(g) + EPS), grad)


def test_environment_tokens_carry_no_gradient(tmp_path):
    cfg = run_config(learning_rate=LR, adam_eps=EPS, grad_clip_norm=0.0)
    cfg = dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, kl_estimator="none")
    )
    trainer = Trainer(cfg, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    batch = random_batch(7)
    mask = _environment_mask(batch)
    assert (mask == 0).sum() > 0 and (mask.sum(axis=1) > 0).all()
    episodes = dataclasses.replace(batch, loss_mask=mask)
    np.testing.assert_array_equal(episodes.completion_mask(), batch.completion_mask() * mask)

    graphdef, before = trainer._graphdef, trainer.params()
    textbook = _textbook_grad(graphdef, batch)
    model_only = _adam_first_step(textbook(before, mask))
    every_token = _adam_first_step(textbook(before, batch.completion_mask()))
    theta0 = host(before)
    trainer.train_step(episodes)
    step = jax.tree.map(lambda a, b: a - b, host(trainer.params()), theta0)
    trainer.close()

    # A float32 gradient's round-off moves an element by about LR·δg/EPS: 1e-6 of LR.
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), step, model_only)))
    assert worst < 1e-3 * LR, worst
    # The environment's tokens would have moved it much further.
    apart = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), every_token, model_only))
    )
    assert apart > 0.1 * LR, apart
