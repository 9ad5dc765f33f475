"""Trainer step throughput on CPU: tokens/s, step time, padding, cost of aligned π_old recompute.

    .venv/bin/python benchmarks/trainer_step.py [--out benchmarks/trainer_step.json]

Models: the ``tiny`` preset and SmolLM2-135M's shape (random weights: timing does not depend on
the values). Batches have realistic ragged lengths (uniform prompt and completion lengths), so
the padding fraction of the length-sorted micro-batches is reported beside the unsorted layout's.
Micro-batch lengths are padded to multiples of 64 (``trainer.length_bucket``), so a few shapes
cover every batch; each configuration runs two warm-up steps (compilation) and then ``--steps``
timed steps, with
alignment off (π_old from one full-sequence forward) and on (the engine's decode replayed token by
token, ``models.scoring``). Also measures the peak f32 matmul FLOP/s of a jitted ``jnp.dot`` in
the same process, and the step's model FLOP/s (6 · params · tokens / step time) as a fraction of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import tempfile
from pathlib import Path

import jax
import numpy as np
from common import dot_peak

from rlax_tpu import models
from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    RunConfig,
    TrainerConfig,
)
from rlax_tpu.trainer import Trainer
from rlax_tpu.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    rows: int
    micro: int
    prompt: tuple[int, int]
    completion: tuple[int, int]
    slots: int  # the engine's rows per decode step (the replay uses the same)


CASES = [
    Case("tiny", rows=64, micro=16, prompt=(16, 64), completion=(8, 96), slots=64),
    Case("smollm2-135m", rows=8, micro=4, prompt=(16, 64), completion=(16, 96), slots=8),
]
GROUP = 4


def batch(case: Case, seed: int, vocab: int, group: int = GROUP) -> TrainBatch:
    r = np.random.default_rng(seed)
    p = r.integers(case.prompt[0], case.prompt[1] + 1, case.rows).astype(np.int32)
    c = r.integers(case.completion[0], case.completion[1] + 1, case.rows).astype(np.int32)
    tokens = r.integers(0, vocab, (case.rows, int((p + c).max()))).astype(np.int32)
    return TrainBatch(
        tokens=tokens,
        prompt_lengths=p,
        completion_lengths=c,
        behaviour_logprobs=-r.uniform(5, 8, (case.rows, case.completion[1])).astype(np.float32),
        rewards=r.integers(0, 2, case.rows).astype(np.float32),
        versions=np.zeros(case.rows, np.int64),
        group_size=group,
    )


def case_config(
    case: Case, *, group: int = GROUP, model: dict | None = None, **trainer: object
) -> RunConfig:
    """The run config of ``case``: its model (with ``model`` overrides, e.g. lora_rank), GRPO
    groups of ``group``, ``trainer`` settings over the defaults."""
    return RunConfig(
        model=models.preset(case.model, **(model or {})),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        trainer=TrainerConfig(
            **{"learning_rate": 1e-5, "checkpoint_every": 1000, "keep_checkpoints": 2, **trainer}
        ),
        inference=InferenceConfig(
            max_prompt_len=case.prompt[1],
            max_new_tokens=case.completion[1],
            max_concurrent_seqs=case.slots,
        ),
        controller=ControllerConfig(
            prompts_per_step=case.rows // group, num_steps=100, snapshot_keep=1001
        ),
        algorithm=AlgorithmConfig(name="grpo", group_size=group),
    )


def timed_steps(
    case: Case,
    *,
    steps: int,
    group: int = GROUP,
    model: dict | None = None,
    **trainer: object,
) -> tuple[int, list[dict[str, float]]]:
    """(parameter count, the metrics of ``steps`` timed updates) of a trainer on ``case``'s
    model (with ``model`` overrides) with ``trainer`` settings, after two updates that compile
    the shapes they use."""
    cfg = case_config(case, group=group, model=model, **trainer)
    model_cfg = cfg.model
    with tempfile.TemporaryDirectory() as tmp:
        trainer_ = Trainer(cfg, checkpoint_dir=tmp)
        n_params = sum(x.size for x in jax.tree.leaves(trainer_.params()))
        for s in range(2):  # compile the length buckets these batches use
            trainer_.train_step(batch(case, 100 + s, model_cfg.vocab_size, group))
        metrics = [
            trainer_.train_step(batch(case, s + 1, model_cfg.vocab_size, group))
            for s in range(steps)
        ]
        trainer_.close()
    return int(n_params), metrics


def run_case(case: Case, align: bool, steps: int, peak: float) -> dict:
    n_params, ms = timed_steps(
        case, steps=steps, micro_batch_size=case.micro, length_bucket=64, align_logprobs=align
    )
    mean = lambda key: float(np.mean([m[key] for m in ms]))  # noqa: E731
    step_s, tok = mean("time_step_s"), mean("sequence_tokens")
    model_flops = 6 * n_params * tok / step_s
    return dict(
        model=case.model,
        params=n_params,
        rows=case.rows,
        micro_batch=case.micro,
        aligned=align,
        step_s=step_s,
        logp_old_s=mean("time_logp_old_s"),
        tokens_per_step=tok,
        tokens_per_s=tok / step_s,
        padding_fraction=mean("padding_fraction"),
        padding_fraction_unsorted=mean("padding_fraction_unsorted"),
        model_flops_per_s=model_flops,
        fraction_of_peak=model_flops / peak,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    peak = dot_peak()
    rows = [run_case(c, a, args.steps, peak) for c in CASES for a in (False, True)]
    result = dict(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        jax=jax.__version__,
        devices=[str(d) for d in jax.devices()],
        peak_matmul_flops_per_s=peak,
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"peak f32 matmul (jitted jnp.dot 2048^2): {peak / 1e9:.1f} GFLOP/s\n")
    print(
        "| model | params | π_old | step s | tokens/s | π_old s | padding (sorted / unsorted) "
        "| model GFLOP/s | of peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {'aligned replay' if r['aligned'] else 'forward'} "
            f"| {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['logp_old_s']:.2f} "
            f"| {r['padding_fraction']:.1%} / {r['padding_fraction_unsorted']:.1%} "
            f"| {r['model_flops_per_s'] / 1e9:.1f} | {r['fraction_of_peak']:.1%} |"
        )
    for m in dict.fromkeys(r["model"] for r in rows):
        off, on = (
            next(r for r in rows if r["model"] == m and r["aligned"] == a) for a in (False, True)
        )
        print(
            f"\n{m}: aligned recompute costs {on['step_s'] / off['step_s'] - 1:+.0%} of the trainer step"
        )


if __name__ == "__main__":
    main()
