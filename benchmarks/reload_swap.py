"""A worker reloading under running jobs: drained against overlapped reloads, and the limit.

    .venv/bin/python benchmarks/reload_swap.py [VERSIONS]

One in-process inference worker (a 8-layer, 512-wide model in float32 on the CPU) behind the
controller's pool in throughput mode. VERSIONS jobs (default 6), one per weight version, are
submitted at once, as a throughput run admits groups of each new version while the older ones
still generate: 8 groups of 2 samples each, lengths drawn lognormal (mean 48 tokens, CV 0.8, cut
at 160; ``ignore_eos``, so the lengths are the draws). Every version is staged ahead (the
standby copy), so a load is a swap.

* Drained (``inference.overlap_reload`` False, the pool's epochs one version at a time): a
  worker finishes a version's longest sample before it loads the next.
* Overlapped (``overlap_reload`` True, opt-in): the next version loads once the last one's jobs
  are queued, its samples running beside the older ones (each on its own weights).
* Limit: the same samples as one job of one version (no reload at all), in the same run.

Reported per mode: wall seconds, engine steps, mean samples running per engine step (of 16 slots), the
longest gap between two engine steps while work waited (a reload's pause), and the wall time
against the limit. Alternates the modes (REPS rounds) so each sees the same machine load; medians.
Writes ``benchmarks/reload_swap.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlax_tpu import models  # noqa: E402
from rlax_tpu.config import InferenceConfig  # noqa: E402
from rlax_tpu.controller.pool import WorkerPool  # noqa: E402
from rlax_tpu.inference.sampler import SamplingParams  # noqa: E402
from rlax_tpu.inference.scheduler import Request  # noqa: E402
from rlax_tpu.inference.worker import DictWeightSource, InferenceWorker  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = models.preset(
    "tiny", vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8
)
CFG = InferenceConfig(
    max_concurrent_seqs=16,
    page_size=16,
    kv_cache_bytes=64 * 2**20,
    prefill_chunk=32,
    max_prompt_len=32,
    max_new_tokens=160,
)
GROUPS, SAMPLES, MEAN, CV = 8, 2, 48.0, 0.8
REPS = 3


def jobs(versions: int, seed: int = 0) -> list[list[Request]]:
    """Each version's groups: prompts of 16-32 tokens, lognormal lengths (module docstring)."""
    rng = np.random.default_rng(seed)
    sigma = float(np.sqrt(np.log1p(CV**2)))
    out = []
    for v in range(versions):
        job = []
        for g in range(GROUPS):
            n = int(np.clip(rng.lognormal(np.log(MEAN) - sigma**2 / 2, sigma), 1, 160))
            prompt = tuple(int(t) for t in rng.integers(0, 4096, int(rng.integers(16, 33))))
            job.append(
                Request(
                    prompt_id=f"v{v}g{g}",
                    prompt_tokens=prompt,
                    num_samples=SAMPLES,
                    sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, seed=v * 100 + g),
                )
            )
        out.append(job)
    return out


class StepClock:
    """Wraps an engine's step: the steps, their decode rows, and the gaps between them."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine, self._step = engine, engine.step
        self.ends: list[float] = []
        self.starts: list[float] = []
        self.rows = 0
        engine.step = self.step

    def step(self) -> list:
        self.starts.append(time.perf_counter())
        self.rows += sum(s.sample_index is not None for s in self.engine.scheduler.running)
        out = self._step()
        self.ends.append(time.perf_counter())
        return out

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.ends, self.starts[1:], strict=False)), default=0)


def run(model, source, work: list[list[Request]], *, overlap: bool, one_job: bool) -> dict:  # noqa: ANN001
    cfg = dataclasses.replace(CFG, overlap_reload=overlap)
    worker = InferenceWorker(model, cfg, weight_source=source)
    worker.engine.precompile()
    pool = WorkerPool([worker], overlap=overlap, on_event=lambda text: None)
    try:
        pool.submit(0, work[0][:1]).result()  # warm: version 0 loaded, programs compiled
        clock = StepClock(worker.engine)
        start = time.perf_counter()
        if one_job:
            futures = [pool.submit(0, [r for job in work for r in job])]
        else:
            for v in range(1, len(work)):
                worker.stage(v)  # in a run, the pool stages each version when its job arrives
            futures = [pool.submit(v, job) for v, job in enumerate(work)]
        rollouts = [ro for f in futures for ro in f.result(timeout=3600)]
        seconds = time.perf_counter() - start
    finally:
        pool.close()
        worker.shutdown()
    assert len(rollouts) == sum(len(j) for j in work) * SAMPLES
    steps = len(clock.ends)
    return {
        "seconds": seconds,
        "steps": steps,
        "rows_per_step": clock.rows / max(steps, 1),
        "longest_gap_s": clock.longest_gap(),
        "tokens": int(sum(len(r.tokens) for r in rollouts)),
    }


def main() -> None:
    versions = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    model = models.init_model(MODEL)
    state = nnx.to_pure_dict(nnx.split(model)[1])
    source = DictWeightSource(
        {v: jax.tree.map(lambda x, v=v: x * (1 + 1e-3 * v), state) for v in range(versions)}
    )
    work = jobs(versions)
    modes = {
        "limit": dict(overlap=True, one_job=True),
        "drained": dict(overlap=False, one_job=False),
        "overlapped": dict(overlap=True, one_job=False),
    }
    rounds = {name: [] for name in modes}
    for _ in range(REPS):
        for name, kw in modes.items():
            rounds[name].append(run(model, source, work, **kw))
    out = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()
    }
    limit = out["limit"]["seconds"]
    print(
        f"{versions} versions x {GROUPS} groups x {SAMPLES} samples, lognormal lengths "
        f"(mean {MEAN:.0f}, CV {CV}), medians of {REPS} rounds"
    )
    print("| mode | seconds | vs limit | engine steps | samples per step | longest gap s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in out.items():
        print(
            f"| {name} | {r['seconds']:.2f} | {r['seconds'] / limit:.2f} | {r['steps']:.0f} | "
            f"{r['rows_per_step']:.1f} | {r['longest_gap_s']:.3f} |"
        )
    out["rounds"] = rounds
    (HERE / "reload_swap.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
