"""Decode speed on SmolLM2-135M: the engine (default, aligned config) against a plain jitted
dense decode and HF transformers, on one wave and on a queue, in one run (issue [decode-speed]).

    make bench-decode BENCH_ARGS="..."   (the benchmark venv for llama.cpp, then this script)
    .venv/bin/python benchmarks/decode_speed.py [--queue 256] [--baseline-waves 1] [--skip-hf]
        [--skip-llama-cpp] [--skip-tunix] [--engine-variant prefill_rows=0 ...]

Workloads (seeded, greedy, so every engine's tokens can be checked against the reference):
  wave   64 requests submitted at once: prompts of U[10, 28] random tokens, output lengths
         U[16, 256] (forced with ignore_eos);
  queue  ``--queue`` such requests (prompts U[16, 64]) through 64 slots: several waves, as in an
         RL step.
Engines:
  engine       rlax_tpu's Engine with the default InferenceConfig (bitwise-aligned replay; on
               CPU the native decode attention), continuous batching;
  plain JAX    the reference: static batches of 64, prefill then every decode step of the batch
               in one jitted ``lax.fori_loop`` (no host round trip per token), f32 weights, a
               dense f32 cache sized to the batch, greedy; the tokens every other engine is
               checked against;
  HF f32/bf16  transformers ``generate`` (torch CPU), greedy, static batches of 64 (left
               padding) run to the batch's longest request.
  Tunix f32    Tunix's sampler over its Llama-3 model with the same f32 weights, greedy, the
               static engines' batches;
  llama.cpp    batched, continuous, over 64 slots, on the whole queue, the GGUF's Q4_1 weights.
               Both run in ``.venv-bench`` (``make bench-venv``) by ``foreign_engines.py``.
  engine (k=v) the engine again with those InferenceConfig fields changed (``--engine-variant``,
               repeatable; comma-separated k=v pairs), e.g. ``prefill_rows=0``.
Only useful tokens count (a request's own length). Static engines run the first
``--baseline-waves`` waves of the queue (i.i.d. waves: the same rate). The engine's decode step
is also timed alone at 64 rows (``decode_profile``'s measurement) and reported as a fraction of the
jitted ``jnp.dot`` peak measured in the same run. Prints a markdown table; writes
``decode_speed.json``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import dot_peak, hf_generate, hf_model, median_time, smollm2, smollm2_path
from decode_profile import model_flops
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import ConfigError, InferenceConfig, from_dict
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.models.programs import decode_program, idle_sampling

HERE = Path(__file__).resolve().parent
BENCH_PYTHON = HERE.parent / ".venv-bench" / "bin" / "python"
SLOTS = 64
OUTPUT = (16, 256)


def workload(n: int, prompt: tuple[int, int], vocab: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(0, vocab, size=int(rng.integers(prompt[0], prompt[1] + 1)))
        length = int(rng.integers(OUTPUT[0], OUTPUT[1] + 1))
        params = SamplingParams(temperature=0.0, max_new_tokens=length, ignore_eos=True, seed=i)
        out.append(
            Request(prompt_id=f"q{i}", prompt_tokens=tuple(int(t) for t in tokens), sampling=params)
        )
    return out


def waves(requests: list[Request], count: int) -> list[list[Request]]:
    return [requests[w * SLOTS : (w + 1) * SLOTS] for w in range(count)]


def useful(batch: list[Request]) -> int:
    return sum(r.sampling.max_new_tokens for r in batch)


# -- the engine -------------------------------------------------------------------------------


def engine_config(max_prompt: int, **changes: int | float | str) -> InferenceConfig:
    """The defaults, sized for the workload (slots, prompt and output budget), with ``changes``."""
    return InferenceConfig(
        max_concurrent_seqs=SLOTS, max_prompt_len=max_prompt, max_new_tokens=OUTPUT[1], **changes
    )


def variant(text: str) -> dict[str, int | float | str]:
    """'prefill_rows=0,attention_kernel=xla' -> InferenceConfig field changes: values are Python
    literals (a bare word is a string), checked by the config's own ``from_dict``."""
    out: dict[str, int | float | str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: expected field=value")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    try:
        from_dict(InferenceConfig, out, "inference")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return out


def run_engine(
    model: models.Transformer,
    requests: list[Request],
    max_prompt: int,
    **changes: int | float | str,
) -> dict:
    cfg = engine_config(max_prompt, **changes)
    warm = Engine(model, cfg)  # compiles the programs outside the timed run (process-wide cache)
    first = requests[0]
    warm.submit(
        dataclasses.replace(first, sampling=dataclasses.replace(first.sampling, max_new_tokens=2))
    )
    warm.run()
    del warm
    engine = Engine(model, cfg)
    for r in requests:
        engine.submit(r)
    start = time.perf_counter()
    rollouts = engine.run()
    wall = time.perf_counter() - start
    tokens = {r.prompt_id: np.asarray(r.tokens) for r in rollouts}
    total = sum(len(t) for t in tokens.values())
    assert total == useful(requests), "the engine did not produce every requested token"
    return dict(
        tokens=total,
        seconds=wall,
        tokens_per_s=total / wall,
        steps=engine.steps,
        compilations=engine.compilations,
        rows_bitwise=engine.rows_bitwise,
        native_attention=engine.cache.native,
        outputs=tokens,
    )


def engine_step(model: models.Transformer, context: int, repeats: int = 7) -> float:
    """Seconds of the engine's decode program at 64 rows, every row at ``context``."""
    engine = Engine(model, engine_config(64))
    n, m = SLOTS, engine.pages_per_seq
    tables = jnp.asarray(
        1 + np.arange(n * m).reshape(n, m) % (engine.cache.num_pages - 1), jnp.int32
    )
    tokens = jnp.asarray(np.arange(n) * 7 % model.cfg.vocab_size, jnp.int32)
    positions = jnp.full((n,), context, jnp.int32)
    sampling = {k: jnp.asarray(v) for k, v in idle_sampling(n).items()}
    sampling["temperature"] = jnp.zeros(n, jnp.float32)  # greedy, as the workloads

    def run():  # noqa: ANN202
        out, engine.cache = decode_program(
            engine.state,
            engine.cache,
            tokens,
            positions,
            tables,
            sampling,
            graphdef=engine.graphdef,
        )
        return out

    return median_time(run, repeats)


# -- the plain JAX reference ------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainCache:
    """A dense cache as one would write it for a static batch: one [B, S, Hkv, D] array per layer
    (updated in place inside the decode loop) and grouped-query attention over all S positions,
    masked past each row's position. Implements ``models.KVCache``."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def create(cls, cfg, batch: int, length: int) -> PlainCache:  # noqa: ANN001
        shape = (batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
        zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in range(cfg.num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, jnp.float32) for _ in range(cfg.num_layers)))

    def attend(self, layer, q, k, v, positions):  # noqa: ANN001, ANN201
        b, s = k.shape[0], self.k[layer].shape[1]
        index = jnp.where(positions >= 0, positions, s)
        rows = jnp.arange(b)[:, None]
        k_layer = self.k[layer].at[rows, index].set(k, mode="drop")
        v_layer = self.v[layer].at[rows, index].set(v, mode="drop")
        hkv, d = k.shape[2], k.shape[3]
        if q.shape[1] == 1:  # decode: XLA:CPU runs broadcast multiply-sums faster than einsums
            qg = q.reshape(b, 1, hkv, -1, d) * (1.0 / d**0.5)  # [B, 1, Hkv, G, D]
            scores = (qg * k_layer[:, :, :, None, :]).sum(-1)  # [B, S, Hkv, G]
            seen = jnp.arange(s)[None, :] <= positions  # [B, S]
            scores = jnp.where(seen[:, :, None, None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=1)
            out = (probs[..., None] * v_layer[:, :, :, None, :]).sum(1)  # [B, Hkv, G, D]
        else:
            qg = q.reshape(b, q.shape[1], hkv, -1, d) * (1.0 / d**0.5)
            scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_layer)
            seen = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B, T, S]
            scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
            out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v_layer)
        cache = PlainCache(
            k=self.k[:layer] + (k_layer,) + self.k[layer + 1 :],
            v=self.v[:layer] + (v_layer,) + self.v[layer + 1 :],
        )
        return out.reshape(q.shape), cache


@partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _plain_step(state, tokens, positions, cache, last, *, graphdef):  # noqa: ANN001, ANN202
    """tokens, positions [B, T]; last [B] the column whose logits pick the next token
    -> (greedy tokens [B], cache)."""
    logits, cache = models.step(nnx.merge(graphdef, state), tokens, positions, cache)
    picked = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return jnp.argmax(picked, axis=-1).astype(jnp.int32), cache


def _static_generate(model, prompt, positions, lengths, steps, cache_len):  # noqa: ANN001, ANN202
    """prompt, positions [B, P] (padding -1 at the end), lengths [B] -> greedy tokens [B, steps]:
    one jitted step per token, everything on device until the end (no host round trip)."""
    graphdef, state = nnx.split(model)
    cache = PlainCache.create(model.cfg, prompt.shape[0], cache_len)
    nxt, cache = _plain_step(state, prompt, positions, cache, lengths - 1, graphdef=graphdef)
    out, zero = [nxt], jnp.zeros_like(lengths)
    for t in range(1, steps):
        nxt, cache = _plain_step(
            state, nxt[:, None], (lengths + t - 1)[:, None], cache, zero, graphdef=graphdef
        )
        out.append(nxt)
    return jnp.stack(out, axis=1)


def run_static(model: models.Transformer, batches: list[list[Request]]) -> dict:
    total, wall, outputs = 0, 0.0, {}
    for batch in batches:
        width = max(len(r.prompt_tokens) for r in batch)
        prompt = np.zeros((len(batch), width), np.int32)
        positions = np.full((len(batch), width), -1, np.int32)
        for b, r in enumerate(batch):
            prompt[b, : len(r.prompt_tokens)] = r.prompt_tokens
            positions[b, : len(r.prompt_tokens)] = np.arange(len(r.prompt_tokens))
        lengths = np.array([len(r.prompt_tokens) for r in batch], np.int32)
        steps = max(r.sampling.max_new_tokens for r in batch)
        args = (model, jnp.asarray(prompt), jnp.asarray(positions), jnp.asarray(lengths))
        cache_len = -(-(width + steps) // 16) * 16  # the batch's longest row, in 16s
        jax.block_until_ready(_static_generate(*args, 2, cache_len))  # compiles both steps
        start = time.perf_counter()
        out = np.asarray(jax.block_until_ready(_static_generate(*args, steps, cache_len)))
        wall += time.perf_counter() - start
        total += useful(batch)
        for b, r in enumerate(batch):
            outputs[r.prompt_id] = out[b, : r.sampling.max_new_tokens]
    return dict(
        tokens=total, seconds=wall, tokens_per_s=total / wall, waves=len(batches), outputs=outputs
    )


# -- HF transformers --------------------------------------------------------------------------


def run_hf(model: models.Transformer, batches: list[list[Request]], dtype: str) -> dict:
    import torch

    torch.manual_seed(0)
    hf = hf_model(model, dtype)
    total, wall, outputs = 0, 0.0, {}
    for batch in batches:
        seconds, tokens = hf_generate(hf, batch, sample=False)
        wall += seconds
        total += useful(batch)
        outputs.update(tokens)
    return dict(
        tokens=total,
        seconds=wall,
        tokens_per_s=total / wall,
        waves=len(batches),
        torch_threads=torch.get_num_threads(),
        outputs=outputs,
    )


# -- engines in the benchmark venv ------------------------------------------------------------


def export_weights(model: models.Transformer, path: Path) -> None:
    """The model's f32 parameters as ``path`` (.npz, keys like ``layers.0.attn.q_proj``) and its
    shape as ``path.with_suffix('.json')``: how the Tunix runner receives the same weights."""
    flat = nnx.to_flat_state(nnx.state(model))
    np.savez(path, **{".".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat})
    c = model.cfg
    path.with_suffix(".json").write_text(
        json.dumps(
            dict(
                num_layers=c.num_layers,
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size,
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.resolved_head_dim,
                rope_theta=c.rope_theta,
                rms_norm_eps=c.rms_norm_eps,
            )
        )
    )


def run_foreign(engine: str, requests: list[Request], weights: Path) -> dict:
    """``foreign_engines.py <engine>`` on ``requests`` in the benchmark venv (a subprocess);
    ``weights``: :func:`export_weights`' file (Tunix reads it; llama.cpp reads the GGUF)."""
    if not BENCH_PYTHON.exists():
        raise SystemExit(
            f"{BENCH_PYTHON} is missing: run `make bench-venv` (or pass --skip-{engine})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        spec = [
            dict(id=r.prompt_id, prompt=list(r.prompt_tokens), length=r.sampling.max_new_tokens)
            for r in requests
        ]
        (Path(tmp) / "requests.json").write_text(json.dumps(spec))
        if engine == "tunix":
            source = ["--weights", str(weights)]
        else:
            source = ["--gguf", str(smollm2_path())]
        cmd = [
            str(BENCH_PYTHON),
            str(HERE / "foreign_engines.py"),
            engine,
            *source,
            "--requests",
            f"{tmp}/requests.json",
            "--slots",
            str(SLOTS),
            "--out",
            f"{tmp}/out.json",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{engine} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        out = json.loads((Path(tmp) / "out.json").read_text())
    assert out["tokens"] == useful(requests), f"{engine} did not produce every requested token"
    out["outputs"] = {k: np.asarray(v) for k, v in out["outputs"].items()}
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    return out


def agreement(got: dict, want: dict) -> dict:
    """Requests whose tokens equal the reference's, over the requests both ran."""
    common = sorted(set(got) & set(want))
    same = [k for k in common if np.array_equal(got[k], want[k])]
    first = [int(np.argmax(got[k] != want[k])) for k in common if k not in same]
    return dict(requests=len(common), equal=len(same), first_divergence=first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queue", type=int, default=256, help="requests in the queued workload")
    ap.add_argument(
        "--baseline-waves", type=int, default=1, help="queue waves the static engines run"
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--skip-tunix", action="store_true")
    ap.add_argument(
        "--engine-variant",
        type=variant,
        action="append",
        default=[],
        help="also run the engine with these InferenceConfig changes, e.g. "
        "prefill_rows=0 (repeatable)",
    )
    ap.add_argument("--out", default=str(HERE / "decode_speed.json"))
    args = ap.parse_args()
    model = smollm2()
    vocab = model.cfg.vocab_size
    peaks = [dot_peak()]
    loads = dict(
        wave=(workload(SLOTS, (10, 28), vocab, seed=0), 28),
        queue=(workload(args.queue, (16, 64), vocab, seed=1), 64),
    )
    results: dict = {}
    scratch = tempfile.TemporaryDirectory()  # the exported weights, written once for both loads
    weights = Path(scratch.name) / "weights.npz"
    if not args.skip_tunix:
        export_weights(model, weights)
    for name, (requests, max_prompt) in loads.items():
        batches = waves(requests, 1 if name == "wave" else args.baseline_waves)
        res = {"engine": run_engine(model, requests, max_prompt)}
        for changes in args.engine_variant:
            label = ",".join(f"{k}={v}" for k, v in changes.items())
            res[f"engine ({label})"] = run_engine(model, requests, max_prompt, **changes)
        res["plain JAX"] = run_static(model, batches)
        if not args.skip_hf:
            for dtype in ("float32", "bfloat16"):
                res[f"HF {dtype}"] = run_hf(model, batches, dtype)
        if not args.skip_tunix:
            res["Tunix f32"] = run_foreign("tunix", [r for b in batches for r in b], weights)
        if not args.skip_llama_cpp:
            res["llama.cpp Q4_1"] = run_foreign("llama-cpp", requests, weights)
        reference = res["plain JAX"]["outputs"]
        for r in res.values():
            r["agreement"] = agreement(r.pop("outputs"), reference)
        results[name] = res
        print(
            f"{name}: " + ", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s" for k, v in res.items()),
            flush=True,
        )
    context = 160
    step = engine_step(model, context)
    peaks.append(dot_peak())
    flops = model_flops(model.cfg, SLOTS, context)
    results["decode_step"] = dict(
        rows=SLOTS,
        context=context,
        seconds=step,
        model_flops=flops,
        peak_flops=peaks,
        fraction_of_peak=flops / step / max(peaks),
    )
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))


def table(results: dict) -> str:
    lines = [
        "| workload | engine | tokens | seconds | tokens/s | engine / this | equal to the "
        "plain JAX reference |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name in ("wave", "queue"):
        ours = results[name]["engine"]["tokens_per_s"]
        for key, r in results[name].items():
            a = r["agreement"]
            lines.append(
                f"| {name} | {key} | {r['tokens']} | {r['seconds']:.1f} | "
                f"{r['tokens_per_s']:.1f} | {ours / r['tokens_per_s']:.2f}x | "
                f"{a['equal']}/{a['requests']} |"
            )
    d = results["decode_step"]
    lines.append(
        f"\nengine decode step, {d['rows']} rows at position {d['context']}: "
        f"{d['seconds'] * 1e3:.1f} ms = {d['model_flops'] / d['seconds'] / 1e9:.0f} "
        f"GFLOP/s = {d['fraction_of_peak']:.1%} of the jnp.dot peak (best of "
        f"{', '.join(f'{p / 1e9:.0f}' for p in d['peak_flops'])} GFLOP/s, start and end "
        "of the run)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
