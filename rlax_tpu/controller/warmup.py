"""The local demo's starting point: a small digit-splitting BPE and a short supervised warm-up.

A randomly initialized tiny model never writes a passing program, so RL would see only zero
rewards. A few hundred steps of next-token training on (prompt, reference program) pairs give it
a policy that sometimes passes; RL then has groups with mixed rewards to learn from.

    tok = build_tokenizer(texts, vocab_size=512)
    model = supervised_warmup(model, [(prompt_ids, completion_ids), ...], steps=300,
                              batch_size=32, learning_rate=3e-3, seed=0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rlax_tpu import models

Example = tuple[Sequence[int], Sequence[int]]  # (prompt ids, completion ids)


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> models.Tokenizer:
    """A deterministic byte-level BPE over ``texts`` with numbers split into single digits.

    Digit by digit (as Llama 3 / Qwen vocabularies do), a constant never seen in training is
    still made of known tokens, so copying it from the statement into the program can generalize.
    """
    return models.Tokenizer.train_bpe(texts, vocab_size=vocab_size, split_digits=True)


def _pack(
    examples: Sequence[Example], pad_id: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded inputs [N, width], next-token targets [N, width] and a loss mask that is 1
    exactly where the target is a completion token."""
    n = len(examples)
    inputs = np.full((n, width), pad_id, np.int32)
    targets = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), np.float32)
    for i, (prompt, completion) in enumerate(examples):
        seq = [*prompt, *completion]
        inputs[i, : len(seq) - 1] = seq[:-1]
        targets[i, : len(seq) - 1] = seq[1:]
        mask[i, len(prompt) - 1 : len(seq) - 1] = 1.0
    return inputs, targets, mask


def _loss(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    inputs: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
) -> jax.Array:
    logits = models.forward(nnx.merge(graphdef, params), inputs)
    nll = -models.token_logprobs(logits, targets)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    params: nnx.State,
    opt_state: optax.OptState,
    inputs: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
):
    loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, params, inputs, targets, mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def supervised_warmup(
    model: models.Transformer,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> models.Transformer:
    """``steps`` AdamW updates of next-token NLL on the completion tokens (prompts are context
    only), on batches of ``batch_size`` examples drawn without replacement per epoch (seeded).

    Batches are padded to their longest row rounded up to 64 columns (a few compiled shapes);
    the same inputs and seed give bit-identical parameters. The learning rate warms up linearly over the first tenth of
    the steps and decays by cosine to a tenth. ``on_step(step, loss)`` is called after each
    update (1-based step). ``model`` is left unchanged; the trained model is returned.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps ({steps}) and batch_size ({batch_size}) must be >= 1")
    if not examples:
        raise ValueError("supervised_warmup: no examples")
    for prompt, completion in examples:
        if not prompt or not completion:
            raise ValueError("supervised_warmup: every example needs a prompt and a completion")
    longest = max(len(p) + len(c) for p, c in examples)
    width = -(-(longest - 1) // 16) * 16  # inputs are the sequence but its last token
    pad_id = 0
    inputs, targets, mask = _pack(examples, pad_id, width)
    lengths = np.array([len(p) + len(c) - 1 for p, c in examples])

    graphdef, stored = nnx.split(model)
    # Trained on float32 masters whatever the storage dtype (a bf16 weight would round most
    # small updates away: trainer/precision.py), returned in the storage dtype. The copy also
    # keeps the caller's buffers, which the step donates.
    params = jax.tree.map(
        lambda x: jnp.array(
            x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, copy=True
        ),
        stored,
    )
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=max(1, steps // 10),
        decay_steps=steps,
        end_value=learning_rate / 10,
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    opt_state = tx.init(params)

    rng = np.random.Generator(np.random.PCG64(seed))
    order: list[int] = []
    for step in range(1, steps + 1):
        picked = []
        while len(picked) < batch_size:
            if not order:
                order = rng.permutation(len(examples)).tolist()
            picked.append(order.pop())
        # Each batch is cut to its own longest row, rounded up to 64 columns: a few compiled
        # shapes instead of padding every batch to the longest example of all.
        w = min(width, -(-int(lengths[picked].max()) // 64) * 64)
        params, opt_state, loss = _train_step(
            graphdef,
            tx,
            params,
            opt_state,
            inputs[picked, :w],
            targets[picked, :w],
            mask[picked, :w],
        )
        if on_step is not None:
            on_step(step, float(loss))
    cast = lambda p, s: p if p.dtype == s.dtype else p.astype(s.dtype)  # noqa: E731
    return nnx.merge(graphdef, jax.tree.map(cast, params, stored))
