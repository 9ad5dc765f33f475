"""Tokens/s of the sharded engine (``inference.mesh``) against the single-device engine, on the same
workload in one run, on 8 forced CPU devices.

    .venv/bin/python benchmarks/inference_mesh.py [--requests 64]

The 8 "devices" share this host's cores, so sharding cannot add compute here: the point is what
the collectives and the partitioned programs cost (the ratio to one device), that the tokens stay
the same, and the TPU numbers of ``python -m rlax_tpu.aot``. The physical limit measured in the
same run is a jitted f32 ``jnp.dot`` on one device; the engine's fraction of it counts 2 FLOPs
per parameter per generated token (attention and padding rows excluded, so a lower bound).
Workload (seeded): greedy, ``ignore_eos``, prompts of U[8, 32] tokens, outputs of U[16, 96], all
submitted at once to an engine of 32 concurrent sequences. Writes JSON next to this file.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import dot_peak  # noqa: E402
from flax import nnx  # noqa: E402

from rlax_tpu import models  # noqa: E402
from rlax_tpu.config import InferenceConfig, MeshConfig  # noqa: E402
from rlax_tpu.inference.engine import Engine  # noqa: E402
from rlax_tpu.inference.sampler import SamplingParams  # noqa: E402
from rlax_tpu.inference.scheduler import Request  # noqa: E402

HERE = Path(__file__).resolve().parent
# A Llama shape whose 8 query / 4 KV heads split 1, 2 and 4 ways.
MODEL = models.preset(
    "tiny",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    max_position_embeddings=256,
)
MESHES = {
    "1 device": MeshConfig(data=1, fsdp=1, tensor=1),
    "tensor 2": MeshConfig(data=1, fsdp=1, tensor=2),
    "tensor 4": MeshConfig(data=1, fsdp=1, tensor=4),
    "data 2 x tensor 2": MeshConfig(data=2, fsdp=1, tensor=2),
}
CFG = InferenceConfig(
    max_concurrent_seqs=32,
    page_size=16,
    kv_cache_bytes=64 * 2**20,
    max_prompt_len=32,
    max_new_tokens=96,
)


def workload(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [
        Request(
            prompt_id=f"r{i}",
            prompt_tokens=tuple(
                int(t) for t in rng.integers(0, MODEL.vocab_size, rng.integers(8, 33))
            ),
            sampling=SamplingParams(
                temperature=0.0, ignore_eos=True, max_new_tokens=int(rng.integers(16, 97))
            ),
        )
        for i in range(n)
    ]


def run(model: models.Transformer, mesh: MeshConfig, requests: list[Request]) -> dict:
    engine = Engine(model, dataclasses.replace(CFG, mesh=mesh))
    engine.precompile()
    for r in workload(4, seed=99):  # warm every program (copies, prefill) outside the timing
        engine.submit(r)
    engine.run()
    for r in requests:
        engine.submit(r)
    start = time.perf_counter()
    done = engine.run()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in done)
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens": tokens,
        "seconds": elapsed,
        "outputs": {r.prompt_id: r.tokens.tolist() for r in done},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    model = models.init_model(MODEL, seed=0)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    requests = workload(args.requests)
    peak = dot_peak()
    results = {name: run(model, mesh, requests) for name, mesh in MESHES.items()}
    base = results["1 device"]
    rows = [
        "| mesh | tokens/s | vs 1 device | same tokens | fraction of jnp.dot peak |",
        "|---|---:|---:|---|---:|",
    ]
    for name, r in results.items():
        same = r["outputs"] == base["outputs"]
        frac = 2 * params * r["tokens_per_s"] / peak
        rows.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
            f"| {'yes' if same else 'no'} | {frac:.3f} |"
        )
    print(
        f"model: {params / 1e6:.1f}M parameters (f32); jnp.dot peak {peak / 1e9:.0f} GFLOP/s "
        f"(one device); {args.requests} requests, {base['tokens']} tokens"
    )
    print("\n".join(rows))
    summary = {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()}
    (HERE / "inference_mesh.json").write_text(
        json.dumps({"peak_flops": peak, "params": params, "results": summary}, indent=2)
    )


if __name__ == "__main__":
    main()
