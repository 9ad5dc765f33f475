"""The trainer's aligned π_old recompute reproduces the real inference engine's log-probs bitwise
(wherever the engine's start-up check finds this host rounds every row alike)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tpu import models
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.trainer import engine_replay_shape
from rlax_tpu.types import TrainBatch

from .helpers import run_config

GROUP = 2


def _submit(
    engine: Engine,
    rng: np.random.Generator,
    prompts: int,
    *,
    temperature: float,
    tag: str = "p",
    seed: int = 0,
) -> None:
    """``prompts`` random prompts of 5, 8, 11, ... tokens, GROUP samples each."""
    for i in range(prompts):
        prompt = tuple(int(x) for x in rng.integers(1, 500, size=5 + 3 * i))
        sampling = SamplingParams(temperature=temperature, seed=seed + i)
        engine.submit(
            Request(
                prompt_id=f"{tag}{i}", prompt_tokens=prompt, num_samples=GROUP, sampling=sampling
            )
        )


def _with(cfg, icfg: InferenceConfig, prompts: int):  # noqa: ANN001, ANN202
    """``cfg`` serving ``icfg``'s engine shapes, ``prompts`` prompts of GROUP a step."""
    return dataclasses.replace(
        cfg,
        inference=icfg,
        controller=dataclasses.replace(cfg.controller, prompts_per_step=prompts),
        algorithm=dataclasses.replace(cfg.algorithm, group_size=GROUP),
    )


def test_aligned_recompute_is_bitwise_the_engine(tmp_path):
    model = models.init_model(models.preset("tiny"), seed=3)
    # step_tokens != max_concurrent_seqs: the replay must follow the engine's rows per step;
    # prefill chunks of 3 tokens, 2 per call: prompt prefixes of 4, 7 and 10 tokens take 2, 3
    # and 4 chunks, several in one call, and the replay must cut them the same way.
    icfg = InferenceConfig(
        max_concurrent_seqs=4,
        step_tokens=6,
        max_prompt_len=16,
        max_new_tokens=12,
        page_size=4,
        prefill_chunk=4,
        kv_cache_bytes=2**22,
        prefill_rows=2,
        prefill_len=3,
    )
    engine = Engine(model, icfg)
    rng = np.random.default_rng(0)
    _submit(engine, rng, 3, temperature=0.9)
    rollouts = sorted(engine.run(), key=lambda r: (r.prompt_id, r.sample_index))
    batch = TrainBatch.from_rollouts(
        rollouts, rng.random(len(rollouts)).astype(np.float32), group_size=GROUP, temperature=0.9
    )
    assert engine_replay_shape(icfg, model.cfg) == engine.replay_shape
    assert engine.replay_shape.slots == engine.step_tokens
    assert engine.prefill_calls >= 5  # 9 chunks, at most 2 per call

    def trainer(align: bool) -> Trainer:
        cfg = _with(run_config(align_logprobs=align, micro_batch_size=2, model=model.cfg), icfg, 3)
        return Trainer(
            cfg, model=model, devices=jax.devices()[:1], checkpoint_dir=tmp_path / str(align)
        )

    aligned = trainer(True)
    on = aligned.train_step(batch)
    aligned.close()
    assert on["aligned_logprobs"] == 1.0
    if engine.rows_bitwise:
        assert on["logp_old_behaviour_diff_max"] == 0.0  # bit for bit
    else:  # this host rounds rows by their index: the engine's tolerance mode
        assert on["logp_old_behaviour_diff_max"] < 1e-5
    plain = trainer(False)
    off = plain.train_step(batch)
    plain.close()
    # Without alignment the difference is reported, not hidden (f32 round-off on CPU: how much,
    # even whether any, depends on the host).
    assert off["aligned_logprobs"] == 0.0
    assert 0.0 <= off["logp_old_behaviour_diff_max"] < 1e-4


class _Sink:
    def __init__(self) -> None:
        self.versions: dict[int, object] = {}

    def push(self, params, version):  # noqa: ANN001, ANN201
        self.versions[version] = jax.tree.map(np.asarray, params)


def test_bf16_published_float32_compute_recompute_is_the_engines_after_an_update(tmp_path):
    """Weights stored and published in bf16, computed in float32: the engine runs on the
    published bf16 values, the trainer holds float32 masters. After an update the aligned π_old
    runs on the published cast (step.old_policy_on_published), so it is still the engine's."""
    cfg_model = models.preset("tiny", num_layers=2, param_dtype="bfloat16")
    model = models.init_model(cfg_model, seed=3)
    icfg = InferenceConfig(
        max_concurrent_seqs=4,
        max_prompt_len=16,
        max_new_tokens=12,
        page_size=4,
        prefill_chunk=4,
        kv_cache_bytes=2**22,
    )
    cfg = run_config(
        align_logprobs=True,
        micro_batch_size=2,
        model=cfg_model,
        publish_dtype="bfloat16",
        learning_rate=1e-3,
    )
    cfg = _with(cfg, icfg, 2)
    sink = _Sink()
    trainer = Trainer(
        cfg, model=model, devices=jax.devices()[:1], checkpoint_dir=tmp_path, sink=sink
    )
    engine = Engine(models.init_model(cfg_model, seed=3), icfg)

    def rollouts(seed: int) -> TrainBatch:
        _submit(engine, np.random.default_rng(seed), 2, temperature=1.0, tag=f"p{seed}-", seed=seed)
        got = sorted(engine.run(), key=lambda r: (r.prompt_id, r.sample_index))
        return TrainBatch.from_rollouts(
            got, np.asarray([1.0, 0.0] * 2, np.float32), group_size=GROUP, temperature=1.0
        )

    trainer.train_step(rollouts(0))
    engine.load_weights(1, sink.versions[1])
    masters = jax.tree.leaves(trainer.params())
    assert any(
        np.any(np.asarray(m) != np.asarray(m.astype(jnp.bfloat16), np.float32)) for m in masters
    )  # the masters hold more than the published bf16
    metrics = trainer.train_step(rollouts(1))
    trainer.close()
    if engine.rows_bitwise:
        assert metrics["logp_old_behaviour_diff_max"] == 0.0
    else:
        assert metrics["logp_old_behaviour_diff_max"] < 1e-5
