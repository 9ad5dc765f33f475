"""Generated tokens/s of the inference engine vs a static-batch JAX baseline and HF `generate`.

    .venv/bin/python benchmarks/inference_throughput.py            # tiny + SmolLM2-135M
    .venv/bin/python benchmarks/inference_throughput.py --models tiny --sequences 128

Workload (seeded): a queue of independent requests (G = 1), prompts of U[16, 64] random tokens,
output lengths between 16 and 256 forced by ``ignore_eos`` + a per-request ``max_new_tokens``,
drawn uniformly (``--lengths uniform``, the default) or log-uniformly (``--lengths log-uniform``:
many short, few long, the shape of RL rollouts that mostly stop early), sampling at T = 1, 64
concurrent sequences; a queue of 1024 requests (tiny) or 512 (SmolLM2), several waves of 64, as
in an RL step, so the engine's drain at the end of the queue is amortized as it is in training.
Measured in one run, on the same weights (f32):
  (a) our engine: continuous batching over the whole queue, with ``--span-groups`` (default 2:
      rows sorted by position attend in two groups, each over its longest row's pages; 0 is the
      bitwise-replay setting, every row over the whole cache);
  (b) static batches of 64 with a dense KV cache (``models.step`` + ``DenseKVCache``, jitted,
      donated), each decoding until its longest sequence ends;
  (c) HF transformers ``generate`` (torch, CPU), the same static batches (left padding,
      ``min_new_tokens = max_new_tokens`` = the batch's longest).
Useful tokens only count (a sequence's own length); the workload's ceiling for (a)/(b) is printed
too: E[longest of 64] / E[length], what an engine whose token rows cost the baseline's decode
rows reaches with free prefill; the static baselines' rates are measured on
the first ``--baseline-waves`` batches of 64 (their rate is the same for every wave: the waves are
i.i.d.), which keeps the run short. Also reported: compilations after warm-up (target 0) and the
KV memory prefix sharing saves at G = 8. Prints a markdown table, writes JSON next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import hf_generate, hf_model, smollm2_path
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.models.paged_cache import page_bytes

SLOTS = 64
PROMPT = (16, 64)
OUTPUT = (16, 256)
HERE = Path(__file__).resolve().parent


def load(name: str) -> models.Transformer:
    if name == "tiny":
        return models.init_model(models.preset("tiny"))
    return models.load_gguf(smollm2_path())[1]


def draw_lengths(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """[n] output lengths in [OUTPUT[0], OUTPUT[1]]: uniform or log-uniform integers."""
    lo, hi = OUTPUT
    if kind == "uniform":
        return rng.integers(lo, hi + 1, size=n)
    return np.minimum(np.floor(np.exp(rng.uniform(np.log(lo), np.log(hi + 1), size=n))), hi).astype(
        np.int64
    )


def ceiling(kind: str, draws: int = 20_000) -> dict:
    """E[longest of a wave of 64] / E[length]: the static baseline's waste, so the most a packed
    engine with the baseline's cost per token row can gain (free prefill)."""
    rng = np.random.default_rng(123)
    waves = draw_lengths(rng, draws * SLOTS, kind).reshape(draws, SLOTS)
    longest, mean = float(waves.max(axis=1).mean()), float(waves.mean())
    return dict(expected_longest=longest, expected_length=mean, ceiling=longest / mean)


def workload(n: int, vocab: int, seed: int = 0, lengths: str = "uniform") -> list[Request]:
    rng = np.random.default_rng(seed)
    outputs = draw_lengths(np.random.default_rng(seed + 1), n, lengths)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, size=int(rng.integers(PROMPT[0], PROMPT[1] + 1)))
        length = int(outputs[i])
        params = SamplingParams(
            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length, ignore_eos=True, seed=i
        )
        out.append(
            Request(prompt_id=f"q{i}", prompt_tokens=tuple(int(t) for t in prompt), sampling=params)
        )
    return out


def engine_config(**overrides) -> InferenceConfig:
    base = InferenceConfig(
        max_concurrent_seqs=SLOTS,
        page_size=16,
        kv_cache_bytes=2**31,
        prefill_chunk=64,
        max_prompt_len=PROMPT[1],
        max_new_tokens=OUTPUT[1],
    )
    return dataclasses.replace(base, **overrides)


# -- (a) our engine ------------------------------------------------------------------------------


def run_engine(model: models.Transformer, requests: list[Request], **overrides) -> dict:
    cfg = engine_config(kv_cache_bytes=SLOTS * 21 * page_bytes(model.cfg, 16), **overrides)
    engine = Engine(model, cfg)
    warm = Engine(model, cfg)  # compiles the prefill and decode programs outside the timed run
    first = requests[0]
    warm.submit(
        dataclasses.replace(first, sampling=dataclasses.replace(first.sampling, max_new_tokens=2))
    )
    warm.run()
    warm.precompile()  # every span grouping's decode program (one when span groups are off)
    del warm
    for r in requests:
        engine.submit(r)
    start = time.perf_counter()
    engine.step()
    after_first = engine.compilations
    rollouts = engine.run()
    wall = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in rollouts)
    assert len(rollouts) == len(requests) and all(
        len(r.tokens) == q.sampling.max_new_tokens
        for r, q in zip(sorted(rollouts, key=lambda r: int(r.prompt_id[1:])), requests, strict=True)
    )
    return dict(
        tokens=tokens,
        seconds=wall,
        tokens_per_s=tokens / wall,
        steps=engine.steps,
        prefill_calls=engine.prefill_calls,
        decode_row_use=tokens / max(1, engine.steps * engine.step_tokens),
        compilations_in_timed_run=engine.compilations,
        compilations_after_first_step=engine.compilations - after_first,
        preemptions=engine.scheduler.num_preemptions,
    )


# -- (b) static batch, dense cache ------------------------------------------------------------------


@partial(jax.jit, static_argnums=0, donate_argnums=4)
def _dense_step(graphdef, state, tokens, positions, cache, key, last):  # noqa: ANN001, ANN202
    logits, cache = models.step(nnx.merge(graphdef, state), tokens, positions, cache)
    picked = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return jax.random.categorical(key, picked, axis=-1).astype(jnp.int32), cache


def run_static(model: models.Transformer, requests: list[Request], waves: int) -> dict:
    graphdef, state = nnx.split(model)
    tokens_total, wall = 0, 0.0
    for w in range(waves):
        batch = requests[w * SLOTS : (w + 1) * SLOTS]
        lengths = np.array([len(r.prompt_tokens) for r in batch])
        steps = max(r.sampling.max_new_tokens for r in batch)
        prompt = np.zeros((SLOTS, PROMPT[1]), np.int32)
        pos = np.full((SLOTS, PROMPT[1]), -1, np.int32)
        for b, r in enumerate(batch):
            prompt[b, : lengths[b]] = r.prompt_tokens
            pos[b, : lengths[b]] = np.arange(lengths[b])
        key = jax.random.key(w)

        def once(prompt=prompt, pos=pos, lengths=lengths, steps=steps, key=key):  # noqa: ANN202
            cache = models.make_dense_cache(model.cfg, SLOTS, PROMPT[1] + OUTPUT[1])
            nxt, cache = _dense_step(
                graphdef,
                state,
                jnp.asarray(prompt),
                jnp.asarray(pos),
                cache,
                jax.random.fold_in(key, 0),
                jnp.asarray(lengths - 1),
            )
            zero = jnp.zeros(SLOTS, jnp.int32)
            for t in range(1, steps):
                p = jnp.asarray((lengths + t - 1)[:, None].astype(np.int32))
                nxt, cache = _dense_step(
                    graphdef, state, nxt[:, None], p, cache, jax.random.fold_in(key, t), zero
                )
            return jax.block_until_ready(nxt)

        if w == 0:  # compile both shapes outside the timing
            _ = _dense_step(
                graphdef,
                state,
                jnp.asarray(prompt),
                jnp.asarray(pos),
                models.make_dense_cache(model.cfg, SLOTS, PROMPT[1] + OUTPUT[1]),
                key,
                jnp.asarray(lengths - 1),
            )
            _ = _dense_step(
                graphdef,
                state,
                jnp.zeros((SLOTS, 1), jnp.int32),
                jnp.zeros((SLOTS, 1), jnp.int32),
                models.make_dense_cache(model.cfg, SLOTS, PROMPT[1] + OUTPUT[1]),
                key,
                jnp.zeros(SLOTS, jnp.int32),
            )
        start = time.perf_counter()
        once()
        wall += time.perf_counter() - start
        tokens_total += sum(r.sampling.max_new_tokens for r in batch)
    return dict(tokens=tokens_total, seconds=wall, tokens_per_s=tokens_total / wall, waves=waves)


# -- (c) HF transformers generate -----------------------------------------------------------------


def run_hf(model: models.Transformer, requests: list[Request], waves: int) -> dict:
    import torch

    torch.manual_seed(0)
    hf = hf_model(model)
    tokens_total, wall = 0, 0.0
    for w in range(waves):
        batch = requests[w * SLOTS : (w + 1) * SLOTS]
        seconds, _ = hf_generate(hf, batch, sample=True)
        wall += seconds
        tokens_total += sum(r.sampling.max_new_tokens for r in batch)
    return dict(
        tokens=tokens_total,
        seconds=wall,
        tokens_per_s=tokens_total / wall,
        waves=waves,
        torch_threads=torch.get_num_threads(),
    )


# -- prefix sharing ---------------------------------------------------------------------------------


def prefix_sharing(model: models.Transformer, group: int = 8, prompt_len: int = 200) -> dict:
    """KV pages of 8 prompts x G samples right after every group forked and wrote its first
    token (outputs long enough that no group finishes before the last one starts), vs. what G
    private copies of each prompt would take."""
    cfg = engine_config(max_prompt_len=256, prefill_chunk=256, step_tokens=SLOTS * 4)
    engine = Engine(model, cfg)
    rng = np.random.default_rng(1)
    for i in range(SLOTS // group):
        prompt = tuple(int(t) for t in rng.integers(0, model.cfg.vocab_size, size=prompt_len))
        engine.submit(
            Request(
                prompt_id=f"g{i}",
                prompt_tokens=prompt,
                num_samples=group,
                sampling=SamplingParams(max_new_tokens=128, ignore_eos=True),
            )
        )
    while any(s.sample_index is None or not s.generated for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    used = sum(a.num_used for a in engine.allocators)
    private = sum(len(s.table.pages) for s in engine.scheduler.running)
    pb = page_bytes(model.cfg, cfg.page_size)
    return dict(
        group=group,
        prompt_len=prompt_len,
        sequences=len(engine.scheduler.running),
        pages_shared=used,
        pages_private=private,
        bytes_shared=used * pb,
        bytes_private=private * pb,
        saved_fraction=1 - used / private,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2-135m")
    parser.add_argument("--sequences", type=int, default=1024, help="requests for the tiny model")
    parser.add_argument("--smollm-sequences", type=int, default=512)
    parser.add_argument("--baseline-waves", type=int, default=1)
    parser.add_argument("--lengths", choices=("uniform", "log-uniform"), default="uniform")
    parser.add_argument(
        "--prefill-rows",
        type=int,
        default=InferenceConfig.prefill_rows,
        help="the engine's prefill program rows (0: prompts as decode rows)",
    )
    parser.add_argument("--prefill-len", type=int, default=InferenceConfig.prefill_len)
    parser.add_argument(
        "--span-groups",
        type=int,
        default=2,
        help="inference.span_groups of the engine (0: every row attends over "
        "the whole cache; the bitwise-replay setting)",
    )
    parser.add_argument(
        "--block-pages",
        type=int,
        default=InferenceConfig.attention_block_pages,
        help="inference.attention_block_pages of the engine (0: every decode "
        "row attends over the whole cache)",
    )
    parser.add_argument("--out", default=str(HERE / "inference_throughput.json"))
    args = parser.parse_args()
    results = {}
    for name in args.models.split(","):
        model = load(name)
        n = args.sequences if name == "tiny" else args.smollm_sequences
        requests = workload(n, model.cfg.vocab_size, lengths=args.lengths)
        r = dict(
            requests=n,
            lengths=args.lengths,
            ceiling=ceiling(args.lengths),
            prefill=(args.prefill_rows, args.prefill_len),
            span_groups=args.span_groups,
            block_pages=args.block_pages,
        )
        print(f"[{name}] engine ...", flush=True)
        r["engine"] = run_engine(
            model,
            requests,
            prefill_rows=args.prefill_rows,
            prefill_len=args.prefill_len,
            span_groups=args.span_groups,
            attention_block_pages=args.block_pages,
        )
        print(f"[{name}] engine: {r['engine']}", flush=True)
        print(f"[{name}] static dense baseline ...", flush=True)
        r["static"] = run_static(model, requests, args.baseline_waves)
        print(f"[{name}] static: {r['static']}", flush=True)
        print(f"[{name}] HF generate ...", flush=True)
        r["hf"] = run_hf(model, requests, args.baseline_waves)
        print(f"[{name}] hf: {r['hf']}", flush=True)
        r["prefix_sharing_g8"] = prefix_sharing(model)
        r["speedup_vs_static"] = r["engine"]["tokens_per_s"] / r["static"]["tokens_per_s"]
        r["speedup_vs_hf"] = r["engine"]["tokens_per_s"] / r["hf"]["tokens_per_s"]
        results[name] = r
        print(json.dumps(r, indent=1), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))  # partial results survive
    results["meta"] = dict(
        jax=jax.__version__,
        devices=str(jax.devices()[0].platform),
        slots=SLOTS,
        prompt=PROMPT,
        output=OUTPUT,
    )
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))


def table(results: dict) -> str:
    lines = [
        "| model | lengths | span groups | (a) engine tok/s | (b) static dense tok/s "
        "| (c) HF generate tok/s "
        "| a/b | workload ceiling of a/b | a/c | compilations after warm-up "
        "| KV saved by sharing (G=8) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name == "meta":
            continue
        s = r["prefix_sharing_g8"]
        lines.append(
            f"| {name} | {r['lengths']} | {r.get('span_groups', 0)} | "
            f"{r['engine']['tokens_per_s']:.0f} | "
            f"{r['static']['tokens_per_s']:.0f} | {r['hf']['tokens_per_s']:.0f} | "
            f"{r['speedup_vs_static']:.2f}x | {r['ceiling']['ceiling']:.2f}x | "
            f"{r['speedup_vs_hf']:.2f}x | {r['engine']['compilations_after_first_step']} | "
            f"{s['saved_fraction']:.0%} ({(s['bytes_private'] - s['bytes_shared']) / 2**20:.1f} MiB "
            f"of {s['bytes_private'] / 2**20:.1f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
