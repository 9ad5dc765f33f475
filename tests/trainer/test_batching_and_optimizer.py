"""Length-bucketed micro-batches (host side), precompiling their shapes, and the optimizer
schedules, by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.config import TrainerConfig
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.batching import micro_arrays, plan_micro_batches, possible_shapes
from rlax_tpu.trainer.mesh import BatchShapeError
from rlax_tpu.trainer.optimizer import make_schedule
from rlax_tpu.trainer.trainer import _combine

from .helpers import GROUP, MAX_NEW, MAX_PROMPT, ROWS, random_batch, run_config


def test_sorting_bounds_padding_and_covers_every_row_once():
    batch = random_batch(3, rows=32)
    plan = plan_micro_batches(batch, micro_batch_size=8, whole_groups=False, bucket=4)
    rows = np.sort(np.concatenate([m.rows for m in plan.micro_batches]))
    np.testing.assert_array_equal(rows, np.arange(32))
    total = batch.prompt_lengths + batch.completion_lengths
    slots = sum(len(m.rows) * m.length for m in plan.micro_batches)
    assert plan.padding_fraction == pytest.approx(1 - total.sum() / slots)
    assert plan.padding_fraction < plan.padding_fraction_unsorted
    for m in plan.micro_batches:  # each micro-batch is padded only to its own longest row
        assert m.length % 4 == 0 and m.length - 4 < total[m.rows].max() <= m.length


def test_whole_groups_stay_together():
    batch = random_batch(4, rows=16)
    plan = plan_micro_batches(batch, micro_batch_size=8, whole_groups=True, bucket=8)
    for m in plan.micro_batches:
        groups = m.rows // 4
        assert all(np.sum(groups == g) == 4 for g in np.unique(groups))
    with pytest.raises(BatchShapeError, match="not a multiple of group_size 4"):
        plan_micro_batches(batch, micro_batch_size=2, whole_groups=True, bucket=8)


def test_a_remainder_micro_batch_only_where_the_loss_allows_it():
    batch = random_batch(5, rows=12)  # e.g. 16 rows of which a verifier-failed group was dropped
    plan = plan_micro_batches(batch, micro_batch_size=8, whole_groups=False, bucket=4)
    assert [len(m.rows) for m in plan.micro_batches] == [8, 4]
    assert sorted(np.concatenate([m.rows for m in plan.micro_batches])) == list(range(12))
    with pytest.raises(BatchShapeError, match="12 rows, not a multiple"):
        plan_micro_batches(batch, micro_batch_size=8, whole_groups=True, bucket=4)
    with pytest.raises(BatchShapeError, match="12 rows, not a multiple"):  # 4 rows on 8 shards
        plan_micro_batches(batch, micro_batch_size=8, whole_groups=False, bucket=4, row_multiple=8)


def test_micro_arrays_layout():
    batch = random_batch(5, rows=4)
    plan = plan_micro_batches(batch, micro_batch_size=4, whole_groups=False, bucket=8)
    mb = plan.micro_batches[0]
    a = micro_arrays(batch, mb)
    for i, row in enumerate(mb.rows):
        p, c = batch.prompt_lengths[row], batch.completion_lengths[row]
        np.testing.assert_array_equal(a["tokens"][i, : p + c], batch.tokens[row, : p + c])
        assert (a["positions"][i, : p + c] == np.arange(p + c)).all()
        assert (a["positions"][i, p + c :] == -1).all()
        np.testing.assert_array_equal(a["targets"][i, :c], batch.tokens[row, p : p + c])


def test_schedules():
    cfg = TrainerConfig(learning_rate=1.0, schedule="warmup_cosine", warmup_steps=10)
    s = make_schedule(cfg, total_steps=110)
    assert s(0) == 0.0 and s(5) == pytest.approx(0.5) and s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.5) and s(110) == pytest.approx(0.0, abs=1e-7)
    wsd = make_schedule(
        TrainerConfig(
            learning_rate=1.0, schedule="warmup_stable_decay", warmup_steps=10, decay_steps=20
        ),
        total_steps=100,
    )
    assert wsd(5) == pytest.approx(0.5) and wsd(50) == 1.0 and wsd(80) == 1.0
    assert wsd(90) == pytest.approx(0.5) and wsd(100) == pytest.approx(0.0)
    const = make_schedule(TrainerConfig(learning_rate=2.0, warmup_steps=4), total_steps=10)
    assert const(2) == pytest.approx(1.0) and const(9) == 2.0


def test_possible_shapes_cover_every_plan():
    shapes = possible_shapes(bucket=16, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW)
    assert shapes == [(16, 16), (32, 16), (32, 32), (48, 16), (48, 32)]
    for seed in range(20):
        batch = random_batch(seed)
        plan = plan_micro_batches(batch, micro_batch_size=4, whole_groups=True, bucket=16)
        assert {(m.length, m.width) for m in plan.micro_batches} <= set(shapes)


@pytest.mark.parametrize("precompile", [True, False])
def test_precompile_leaves_no_compile_for_later_steps(tmp_path, precompile):
    # The first batch is short; the second has the longest rows the limits allow (a new shape).
    trainer = Trainer(
        run_config(length_bucket=16, precompile=precompile),
        checkpoint_dir=tmp_path,
        devices=jax.devices()[:1],
    )
    short = random_batch(
        0, prompt_lengths=np.full(ROWS, 2, np.int32), completion_lengths=np.full(ROWS, 3, np.int32)
    )
    first = trainer.train_step(short)["update_compilations"]
    long = random_batch(
        1,
        prompt_lengths=np.full(ROWS, MAX_PROMPT, np.int32),
        completion_lengths=np.full(ROWS, MAX_NEW, np.int32),
        tokens=np.ones((ROWS, MAX_PROMPT + MAX_NEW), np.int32),
    )
    second = trainer.train_step(long)["update_compilations"]
    assert (second == first) is precompile


def test_loss_terms_of_micro_batches_add_up_to_the_batchs(tmp_path, algorithm="grpo"):
    # The objective's value and the loss's terms are parts of one batch-normalized sum (Eq. 3):
    # the step reports the same whatever the micro-batching.
    batch = random_batch(3)
    whole, split = (
        Trainer(
            run_config(algorithm=algorithm, micro_batch_size=m),
            checkpoint_dir=tmp_path / str(m),
            devices=jax.devices()[:1],
        ).train_step(batch)
        for m in (ROWS, GROUP)
    )
    names = ["loss", "objective", "policy_loss", "policy_objective", "kl_loss"]
    for name in names:
        np.testing.assert_allclose(split[name], whole[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert whole["objective"] != 0.0


def test_sequence_objectives_average_their_micro_batches():
    # tb / online_dpo normalize per micro-batch (the loss is scaled by 1/n): so are their terms;
    # other metrics stay token-weighted means.
    parts = [
        (10.0, {"objective": 2.0, "ratio_mean": 1.0}),
        (30.0, {"objective": 4.0, "ratio_mean": 2.0}),
    ]
    out = _combine(parts, scale=0.5)
    assert out["objective"] == 3.0 and out["ratio_mean"] == 1.75


def test_weight_decay_takes_the_matrices_and_leaves_norms_and_biases_whatever_their_rank():
    """[pod-fidelity]: the q/k/v biases are stored [heads, head_dim] and were decayed by a mask
    of rank >= 2, against the optimizer's docstring. One AdamW step on a zero gradient with
    weight decay: only matrices shrink."""
    import optax

    from rlax_tpu.trainer.optimizer import make_optimizer

    params = {
        "embed": jnp.ones((8, 4)),
        "final_norm": {"weight": jnp.ones((4,))},
        "layers": [
            {
                "attn": {
                    "q_bias": jnp.ones((2, 2)),
                    "o_bias": jnp.ones((4,)),
                    "q_proj": jnp.ones((4, 2, 2)),
                },
                "input_norm": {"weight": jnp.ones((4,))},
            }
        ],
        "experts": {"router": jnp.ones((4, 3))},
    }
    tx = make_optimizer(
        TrainerConfig(learning_rate=0.1, weight_decay=0.5, warmup_steps=0, grad_clip_norm=0.0),
        total_steps=10,
    )
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    after = optax.apply_updates(params, updates)
    shrunk = {
        jax.tree_util.keystr(path): bool(jnp.all(leaf < 1.0))
        for path, leaf in jax.tree_util.tree_leaves_with_path(after)
    }
    assert shrunk == {
        "['embed']": True,
        "['experts']['router']": True,
        "['final_norm']['weight']": False,
        "['layers'][0]['attn']['o_bias']": False,
        "['layers'][0]['attn']['q_bias']": False,
        "['layers'][0]['attn']['q_proj']": True,
        "['layers'][0]['input_norm']['weight']": False,
    }
