"""LoRA against full fine-tuning on SmolLM2-135M's shape: trainer step time, per-device memory
of the trainer's programs, and bytes per published version, measured in one process.

    .venv/bin/python benchmarks/lora.py            # writes benchmarks/lora.json

Trainer step: one 64-row GRPO update of the smollm2 preset's shape (random weights: timing does
not depend on the values), the preset's trainer settings (no remat, micro-batches of 16, π_old
prefill-shaped), full fine-tuning at lr 1e-5 and LoRA (rank 16 on every projection) at 1e-4,
after two compiling updates, 3 timed updates each. Model FLOP/s against a jitted ``jnp.dot``'s
peak measured in the same process: 6 · params · tokens for full fine-tuning; for LoRA the
frozen base's weight gradients are not computed, so 4 · params · tokens (the adapters' own
FLOPs are under 1%).

Memory: the same trainer's programs lowered and compiled for this host's CPU device with
``python -m rlax_tpu.aot``'s code (``rlax_tpu.aot.check``): the gradient step's peak (its
arguments, outputs and temporaries, plus what the trainer holds beside it), and the resident
state by name.

Publish: each trainer publishes version 0 to a real parameter server on 127.0.0.1 (gRPC); the
client's count of bytes sent, against the loopback rate of that push.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from common import dot_peak
from trainer_step import Case, case_config, timed_steps

from rlax_tpu.aot.check import compile_program
from rlax_tpu.aot.chips import CHIPS, DeviceSpec
from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.service import serve
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.aot import abstract_programs

CASE = Case("smollm2-135m", rows=64, micro=16, prompt=(40, 56), completion=(16, 64), slots=64)
GROUP = 8
PRESET = dict(remat=False, micro_batch_size=16, old_logprobs="prefill")
# LoRA for RL: rank matters little and the best learning rate is about 10x full fine-tuning's
# (Schulman et al., "LoRA Without Regret", Thinking Machines, 2025).
SETTINGS = {
    "full fine-tuning": (None, dict(learning_rate=1e-5)),
    "LoRA rank 16": (dict(lora_rank=16, lora_alpha=32.0), dict(learning_rate=1e-4)),
}


def memory(model: dict | None, trainer: dict) -> dict:
    """Per-device bytes of the gradient step (peak) and of the resident state by name."""
    cfg = case_config(CASE, group=GROUP, model=model, **PRESET, **trainer)
    programs = {p.name: p for p in abstract_programs(cfg, jax.devices()[:1])}
    device = DeviceSpec(CHIPS["v5p"], 1, 2**40, "this benchmark: unbounded")
    acc = programs["trainer.accumulate"]
    report = compile_program(acc, component="trainer", topology="cpu", device=device)
    resident = dict(programs["trainer.prepare"].held)  # all resident state, no program argument
    return dict(
        gradient_step_peak=int(report.peak_bytes),
        gradient_step_temp=int(report.temp_bytes),
        resident={k: int(v) for k, v in resident.items() if "micro-batch" not in k},
    )


def publish_bytes(model: dict | None, trainer: dict) -> dict:
    """Bytes one published version sends to a parameter server on 127.0.0.1, and the push's
    rate."""
    server, port, _ = serve(ParamServerConfig(persist_every=0))
    client = ParamServerClient(f"127.0.0.1:{port}")
    client.wait_ready()
    cfg = case_config(CASE, group=GROUP, model=model, **PRESET, **trainer)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t = Trainer(cfg, sink=client, checkpoint_dir=tmp)
            start = time.perf_counter()
            t.publish()
            seconds = time.perf_counter() - start
            t.close()
        return dict(bytes=int(client.bytes_pushed), seconds=seconds)
    finally:
        client.close()
        server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    peak = dot_peak()
    rows = []
    for name, (model, trainer) in SETTINGS.items():
        n, ms = timed_steps(CASE, steps=args.steps, group=GROUP, model=model, **PRESET, **trainer)
        mean = lambda key, ms=ms: float(np.mean([m[key] for m in ms]))  # noqa: E731
        step, tokens = mean("time_step_s"), mean("sequence_tokens")
        flops = (4 if model else 6) * n * tokens
        row = dict(
            name=name,
            params=n,
            step_s=step,
            update_s=mean("time_update_s"),
            logp_old_s=mean("time_logp_old_s"),
            tokens=tokens,
            fraction_of_peak=flops / step / peak,
            memory=memory(model, trainer),
            publish=publish_bytes(model, trainer),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    full, lora = rows
    summary = dict(
        step_speedup=full["step_s"] / lora["step_s"],
        peak_ratio=lora["memory"]["gradient_step_peak"] / full["memory"]["gradient_step_peak"],
        publish_ratio=lora["publish"]["bytes"] / full["publish"]["bytes"],
    )
    print(json.dumps(summary), flush=True)
    Path(args.out).write_text(
        json.dumps(
            dict(
                rows=rows,
                summary=summary,
                peak_flops_per_s=peak,
                jax=jax.__version__,
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            ),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
