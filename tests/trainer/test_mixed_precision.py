"""Every preset that trains, at its own dtypes, optimizer and learning rate on a scaled-down
model, updates its weights as an all-float32 run does (trainer/precision.py).

Each case trains twice from the same weights (the preset's storage dtype, so both start equal):
the preset's dtypes, and everything in float32. The preset must move its master weights as the
float32 run moves its own, change its published weights where the float32 run's cast to the
publish dtype changes, and raise the fixed batch's policy-gradient objective as that run does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import (
    AlgorithmConfig,
    ConfigError,
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    RunConfig,
    TrainerConfig,
)
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.batching import MicroBatch, micro_arrays
from rlax_tpu.trainer.precision import check_master_dtype, half_spacing, movable_fraction

from .helpers import MAX_NEW, MAX_PROMPT, random_batch

REPO = Path(__file__).resolve().parents[2]
PRESETS = [
    ("codeforces", "local"),
    ("codeforces", "tpu_vm"),
    ("codeforces", "v5p_small"),
    ("codeforces", "v5p"),
    ("smollm2_math", "cpu"),
    ("smollm2_math", "tpu"),
]
PROMPTS = 1  # prompts per batch; rows = PROMPTS x the preset's group size
FIRST_UPDATES = 3  # the master weights after these are compared
MORE_UPDATES = 17  # then the published weights after this many more
_MODEL_FIELDS = ("arch", "qkv_bias", "qk_norm", "tie_embeddings", "param_dtype", "compute_dtype")
_TRAINER_FIELDS = (
    "learning_rate",
    "schedule",
    "warmup_steps",
    "decay_steps",
    "weight_decay",
    "adam_b1",
    "adam_b2",
    "adam_eps",
    "grad_clip_norm",
    "micro_batch_size",
    "publish_dtype",
    "master_dtype",
    "remat",
    "remat_policy",
    "scan_layers",
)
_ALGORITHM_FIELDS = ("name", "group_size", "eps_low", "eps_high", "kl_estimator", "kl_coef")


def _preset(module: str, preset: str) -> dict:
    spec = importlib.util.spec_from_file_location(
        f"{module}_cfg", REPO / "configs" / f"{module}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(preset).to_dict()


def scaled_down(raw: dict, **model: str) -> RunConfig:
    """The preset's model family and dtypes at the tiny shape (2 layers), its optimizer,
    learning-rate schedule (over its own num_steps) and algorithm; one CPU device."""
    pick = lambda d, names: {k: d[k] for k in names if k in d}  # noqa: E731
    trainer = pick(raw["trainer"], _TRAINER_FIELDS) | dict(
        # π_old from the training forward: this test is about the update, not alignment.
        align_logprobs=False,
        length_bucket=64,
        checkpoint_every=50,
    )
    algorithm = pick(raw["algorithm"], _ALGORITHM_FIELDS)
    # A micro-batch is at most the batch (the presets' larger ones only split bigger steps).
    rows = PROMPTS * algorithm.get("group_size", AlgorithmConfig().group_size)
    trainer["micro_batch_size"] = min(trainer.get("micro_batch_size", rows), rows)
    return RunConfig(
        model=models.preset("tiny", num_layers=2, **(pick(raw["model"], _MODEL_FIELDS) | model)),
        mesh=MeshConfig(data=1, fsdp=1, tensor=1),
        trainer=TrainerConfig(**trainer),
        inference=InferenceConfig(
            prefill_chunk=8, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW
        ),
        controller=ControllerConfig(
            prompts_per_step=PROMPTS, num_steps=raw["controller"]["num_steps"], snapshot_keep=51
        ),
        algorithm=AlgorithmConfig(**algorithm),
    )


def _all_float32(cfg: RunConfig) -> RunConfig:
    f32 = "float32"
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, param_dtype=f32, compute_dtype=f32),
        trainer=dataclasses.replace(cfg.trainer, publish_dtype=f32, master_dtype=f32),
    )


def _trainer(cfg: RunConfig, start: dict, tmp_path: Path, name: str) -> Trainer:
    model = models.Transformer(cfg.model, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x, s: jnp.asarray(s, x.dtype), pure, start))
    nnx.update(model, state)
    return Trainer(cfg, model=model, devices=jax.devices()[:1], checkpoint_dir=tmp_path / name)


def _host(tree) -> list[np.ndarray]:  # noqa: ANN001
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def _published(trainer: Trainer) -> list[np.ndarray]:
    cast = trainer._fns.publish_cast(trainer.params(), trainer.config.trainer.publish_dtype)
    return _host(cast)


def _objective(scorer: Trainer, params: dict, batch) -> float:  # noqa: ANN001
    """J = mean_i A_i mean_t log π(o_i,t) in float32 (GRPO advantages of the batch's rewards),
    scored by the float32 run's graph whatever dtype ``params`` are in."""
    groups = batch.rewards.reshape(-1, batch.group_size)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
    width = int(batch.completion_lengths.max())
    length = int((batch.prompt_lengths + batch.completion_lengths).max())
    mb = MicroBatch(rows=np.arange(batch.num_rows), length=length, width=width)
    arrays = {k: jnp.asarray(v) for k, v in micro_arrays(batch, mb).items()}
    f32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    logp, _ = scorer._fns.score(f32, None, arrays, jnp.float32(batch.temperature))
    mask = np.arange(width)[None, :] < batch.completion_lengths[:, None]
    per_row = (np.asarray(logp) * mask).sum(1) / mask.sum(1)
    return float((adv.reshape(-1) * per_row).mean())


def _precision_cases() -> dict[str, RunConfig]:
    """One scaled-down config per distinct precision setting among PRESETS, named by the presets
    it stands for: presets whose scaled-down configs differ only in batch rows (group size,
    micro-batch) and run length (the schedule's horizon, a few 1e-3 of the learning rate over
    these 20 updates) update alike (v5p_small is v5p's at 8 samples a prompt)."""
    cases: dict[str, tuple[list[str], RunConfig]] = {}
    for module, preset in PRESETS:
        cfg = scaled_down(_preset(module, preset))
        key = repr(
            dataclasses.replace(
                cfg,
                controller=dataclasses.replace(cfg.controller, num_steps=1),
                algorithm=dataclasses.replace(cfg.algorithm, group_size=2),
                trainer=dataclasses.replace(cfg.trainer, micro_batch_size=2),
            )
        )
        cases.setdefault(key, ([], cfg))[0].append(f"{module}:{preset}")
    return {"+".join(names): cfg for names, cfg in cases.values()}


CASES = _precision_cases()


def test_presets_that_update_alike_share_a_case():
    # v5p_small is v5p at 8 samples a prompt; the others differ in dtypes, optimizer or model.
    assert sorted(CASES) == [
        "codeforces:local",
        "codeforces:tpu_vm",
        "codeforces:v5p_small+codeforces:v5p",
        "smollm2_math:cpu",
        "smollm2_math:tpu",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_updates_as_float32_does(case, tmp_path):
    cfg = CASES[case]
    ref_cfg = _all_float32(cfg)
    # Both start from the preset's stored weights (initialized in its param dtype).
    init = models.Transformer(cfg.model, rngs=nnx.Rngs(cfg.model.seed))
    start = nnx.to_pure_dict(nnx.state(init, nnx.Param))
    ref = _trainer(ref_cfg, start, tmp_path, "ref")
    # An all-float32 preset is its own float32 run (its comparisons hold by construction).
    ours = ref if cfg == ref_cfg else _trainer(cfg, start, tmp_path, "ours")
    trainers = (ref,) if ours is ref else (ours, ref)
    vocab, rows = cfg.model.vocab_size, PROMPTS * cfg.algorithm.group_size
    batch = random_batch(
        0,
        rows=rows,
        vocab=vocab,
        group_size=cfg.algorithm.group_size,
        rewards=np.tile([1.0, 0.0], rows // 2).astype(np.float32),
    )
    w0 = _host(ref.params())
    j0 = _objective(ref, ref.params(), batch)
    pub0 = _published(ref)

    for _ in range(FIRST_UPDATES):
        for t in trainers:
            assert t.train_step(batch)["skipped"] == 0.0
    ours_w, ref_w = _host(ours.params()), _host(ref.params())
    moved = np.sqrt(sum(np.sum((w - a) ** 2) for w, a in zip(ours_w, w0, strict=True)))
    moved_ref = np.sqrt(sum(np.sum((w - a) ** 2) for w, a in zip(ref_w, w0, strict=True)))
    assert moved_ref > 0
    assert abs(moved / moved_ref - 1) < 0.10, (moved, moved_ref)
    changed = np.concatenate([(w != a).ravel() for w, a in zip(ours_w, w0, strict=True)])
    changed_ref = np.concatenate([(w != a).ravel() for w, a in zip(ref_w, w0, strict=True)])
    assert changed_ref.mean() > 0.5
    assert changed[changed_ref].mean() > 0.99, changed[changed_ref].mean()

    for _ in range(MORE_UPDATES):
        for t in trainers:
            assert t.train_step(batch)["skipped"] == 0.0
    # Published weights: ours in the preset's publish dtype, the float32 run's cast to it.
    ours_pub = _published(ours)
    ref_pub = _host(jax.tree.map(lambda x: x.astype(cfg.trainer.publish_dtype), ref.params()))
    start_pub = _host(
        jax.tree.map(lambda x: jnp.asarray(x).astype(cfg.trainer.publish_dtype), pub0)
    )
    ours_changed = np.concatenate(
        [(p != s).ravel() for p, s in zip(ours_pub, start_pub, strict=True)]
    )
    ref_changed = np.concatenate(
        [(p != s).ravel() for p, s in zip(ref_pub, start_pub, strict=True)]
    )
    assert ref_changed.sum() > 0
    agree = (ours_changed & ref_changed).sum() / (ours_changed | ref_changed).sum()
    assert agree > 0.8, (agree, ours_changed.mean(), ref_changed.mean())

    # The fixed batch, repeated, raised its objective (lowered its loss) as much as float32's.
    gain = _objective(ref, ours.params(), batch) - j0
    gain_ref = _objective(ref, ref.params(), batch) - j0
    assert gain_ref > 0
    assert 0.5 < gain / gain_ref < 1.5, (gain, gain_ref)
    for t in trainers:
        t.close()


def test_half_spacing_is_the_rounding_threshold_of_bfloat16():
    w = jnp.asarray([0.01, -0.3, 1.0, 3e-5], jnp.bfloat16)
    gap = half_spacing(w, "bfloat16")
    # A step just over half the spacing moves the stored weight, just under rounds back.
    assert bool(jnp.all((w + (gap * 1.01).astype(jnp.float32)).astype(jnp.bfloat16) != w))
    assert bool(jnp.all((w.astype(jnp.float32) + gap * 0.99).astype(jnp.bfloat16) == w))
    # The arithmetic: |w| = 0.01 in bf16 moves only by more than ~3e-5.
    assert float(gap[0]) == 2.0**-15
    assert float(half_spacing(jnp.zeros(1), "bfloat16")[0]) == 0.0


def test_bfloat16_masters_are_refused_where_adamw_steps_round_to_nothing():
    params = {"w": 0.02 * jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)}
    assert movable_fraction(params, 1e-6, "bfloat16") < 0.05
    assert movable_fraction(params, 1e-6, "float32") == 1.0
    with pytest.raises(ConfigError, match=r"trainer.master_dtype = 'bfloat16': an AdamW step"):
        check_master_dtype(params, master_dtype="bfloat16", learning_rate=1e-6)
    # A learning rate well above the weights' bf16 spacing can learn in bf16.
    assert check_master_dtype(params, master_dtype="bfloat16", learning_rate=1e-3) > 0.9


def test_master_copy_optimizer_state_and_reference_dtypes(tmp_path):
    raw = _preset("codeforces", "tpu_vm")
    raw["algorithm"]["kl_estimator"] = "k3"  # a frozen reference too
    cfg = scaled_down(raw)
    trainer = Trainer(cfg, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    dtypes = lambda tree: {x.dtype for x in jax.tree.leaves(tree) if x.ndim}  # noqa: E731
    assert dtypes(trainer.params()) == {jnp.dtype(jnp.float32)}
    assert dtypes(trainer._opt_state) == {jnp.dtype(jnp.float32)}
    assert dtypes(trainer._ref_params) == {jnp.dtype(jnp.bfloat16)}
    trainer.close()
