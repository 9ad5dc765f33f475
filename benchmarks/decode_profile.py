"""Where a decode step's time goes: the engine's decode program on SmolLM2-135M, and each of its
parts jitted alone at the same shapes (issue [decode-speed]).

    .venv/bin/python benchmarks/decode_profile.py [--rows 64] [--context 160] [--repeats 7]
        [--kernel auto|native|xla] [--block-pages 4] [--out decode_profile.json]

Rows hold sequences at position ``--context`` (the workload's mean longest row); the cache is
the engine's default (max_prompt_len + max_new_tokens positions per sequence). Each part is timed
as its own jitted program (median of ``--repeats`` after a warm-up) and summed per step (x
layers where it runs per layer); the parts' sum is compared with the whole program's time and
the model FLOPs with the jitted ``jnp.dot`` peak measured in the same run. Prints a markdown
table; writes ``decode_profile.json`` next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import dot_peak, median_time, smollm2
from flax import nnx

from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.engine import Engine
from rlax_tpu.models import native_attention
from rlax_tpu.models.attention import causal_mask, dot_product_attention
from rlax_tpu.models.paged_attention import block_attention, gather_pages
from rlax_tpu.models.programs import decode_program, idle_sampling
from rlax_tpu.models.sampling import sample

HERE = Path(__file__).resolve().parent


def model_flops(cfg, rows: int, context: int) -> float:  # noqa: ANN001
    """Matmul FLOPs of one decode step: 2 x parameters touched per row, plus attention."""
    e, f, h, hkv, d = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.resolved_head_dim,
    )
    per_layer = e * h * d * 2 + 2 * e * hkv * d + 3 * e * f
    attention = 2 * 2 * h * d * context
    return rows * (
        2 * (cfg.num_layers * per_layer + e * cfg.vocab_size) + cfg.num_layers * attention
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--block-pages",
        type=int,
        default=InferenceConfig.attention_block_pages,
        help="inference.attention_block_pages (0: attention over the whole cache)",
    )
    ap.add_argument(
        "--kernel",
        default=InferenceConfig.attention_kernel,
        choices=("auto", "native", "xla"),
        help="inference.attention_kernel",
    )
    ap.add_argument("--out", default=str(HERE / "decode_profile.json"))
    args = ap.parse_args()
    n, ctx = args.rows, args.context
    model = smollm2()
    cfg = model.cfg
    icfg = InferenceConfig(
        max_concurrent_seqs=n, attention_block_pages=args.block_pages, attention_kernel=args.kernel
    )
    engine = Engine(model, icfg)
    m, page = engine.pages_per_seq, icfg.page_size
    s = m * page
    layers = cfg.num_layers
    e, hkv, d, h = cfg.hidden_size, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.num_heads
    rng = np.random.default_rng(0)
    tables = jnp.asarray(
        (1 + np.arange(n * m).reshape(n, m)) % (engine.cache.num_pages - 1) + 1, jnp.int32
    )
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, n), jnp.int32)
    positions = jnp.full((n,), ctx, jnp.int32)
    sampling = {k: jnp.asarray(v) for k, v in idle_sampling(n).items()}
    rows = {}

    def run_decode():
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

    rows["whole decode program"] = (median_time(run_decode, args.repeats), 1)

    x = jnp.asarray(rng.standard_normal((n, 1, e)), jnp.float32)
    layer = model.layers[0]
    gd, st = nnx.split(layer)

    @jax.jit
    def projections(st, x):
        lay = nnx.merge(gd, st)
        a = lay.attn
        hx = lay.input_norm(x)
        q = a._project(hx, a.q_proj, a.q_bias)
        k = a._project(hx, a.k_proj, a.k_bias)
        v = a._project(hx, a.v_proj, a.v_bias)
        y = jnp.einsum("bthd,hde->bte", q, a.o_proj[...])
        x = x + y + (k.sum() + v.sum()) * 0
        return x + lay.mlp(lay.post_attn_norm(x))

    rows["layer projections + norms + MLP (x layers)"] = (
        median_time(lambda: projections(st, x), args.repeats),
        layers,
    )
    k_pages = engine.cache.k_pages[0]
    v_pages = engine.cache.v_pages[0]
    gather = jax.jit(lambda kp, vp, t: (gather_pages(kp, t), gather_pages(vp, t)))
    if engine.cache.native:
        native = jax.jit(
            lambda q, kp, vp, t, p: native_attention.decode_attention(
                q, q[:, :hkv], q[:, :hkv], kp, vp, t, p, layer=0
            ),
            donate_argnums=(1, 2),
        )
        q1 = jnp.asarray(rng.standard_normal((n, h, d)), jnp.float32)
        pages = [engine.cache.k_pages, engine.cache.v_pages]

        def run_native():
            out, pages[0], pages[1] = native(q1, pages[0], pages[1], tables, positions)
            return out

        rows[f"native attention + K/V writes over {ctx} positions (x layers)"] = (
            median_time(run_native, args.repeats),
            layers,
        )
        engine.cache = dataclasses.replace(engine.cache, k_pages=pages[0], v_pages=pages[1])
    elif args.block_pages:
        block = jax.jit(
            lambda q, kp, vp, t, p: block_attention(q, kp, vp, t, p, block_pages=args.block_pages)
        )
        q1 = jnp.asarray(rng.standard_normal((n, 1, h, d)), jnp.float32)
        rows[
            f"block attention over {ctx} positions, {args.block_pages} pages a block (x layers)"
        ] = (
            median_time(
                lambda: block(q1, k_pages, v_pages, tables, positions[:, None]), args.repeats
            ),
            layers,
        )
    rows[f"for comparison: page gather K+V, {s} positions (x layers)"] = (
        median_time(lambda: gather(k_pages, v_pages, tables), args.repeats),
        layers,
    )
    kd = jnp.asarray(rng.standard_normal((n, s, hkv, d)), jnp.float32)
    qd = jnp.asarray(rng.standard_normal((n, 1, h, d)), jnp.float32)
    stored = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s))
    attn = jax.jit(lambda q, k, v, p: dot_product_attention(q, k, v, causal_mask(p, stored)))
    rows[f"for comparison: einsums + softmax over all {s} (x layers)"] = (
        median_time(lambda: attn(qd, kd, kd, positions[:, None]), args.repeats),
        layers,
    )
    write = jax.jit(lambda kp, t, k: kp.at[:, t[:, 0], 3].set(k.transpose(1, 0, 2)))
    kn = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.float32)
    rows[
        "cache write K, XLA scatter (x 2 x layers"
        + (", for comparison)" if engine.cache.native else ")")
    ] = (median_time(lambda: write(k_pages, tables, kn), args.repeats), 2 * layers)
    hidden = jnp.asarray(rng.standard_normal((n, 1, e)), jnp.float32)
    head = jax.jit(lambda hd: model.logits(hd))
    rows["vocabulary projection (tied embedding)"] = (
        median_time(lambda: head(hidden), args.repeats),
        1,
    )
    logits = head(hidden)[:, 0]
    samp = jax.jit(lambda z, s: sample(z, **s, native=engine.cache.native))
    rows[
        "sampler, T = 1 ("
        + ("native logit statistics, " if engine.cache.native else "")
        + "inverse CDF, 2 picked log-probs)"
    ] = (median_time(lambda: samp(logits, sampling), args.repeats), 1)
    greedy = dict(sampling, temperature=jnp.zeros(n, jnp.float32))
    rows["sampler, greedy"] = (median_time(lambda: samp(logits, greedy), args.repeats), 1)
    noise = jax.jit(
        jax.vmap(
            lambda seed: jax.random.gumbel(jax.random.key(seed), (cfg.vocab_size,), jnp.float32)
        )
    )
    rows["  for comparison: Gumbel noise [rows, V] (the old draw)"] = (
        median_time(lambda: noise(sampling["seeds"]), args.repeats),
        1,
    )
    lsm = jax.jit(lambda z: jax.nn.log_softmax(z, axis=-1))
    rows["  for comparison: one full log-softmax [rows, V]"] = (
        median_time(lambda: lsm(logits), args.repeats),
        1,
    )

    def host():
        arrays = [
            jnp.asarray(np.asarray(tokens)),
            jnp.asarray(np.asarray(positions)),
            jnp.asarray(np.asarray(tables)),
        ]
        arrays += [jnp.asarray(v) for v in idle_sampling(n).values()]
        return jax.device_get(arrays)

    t0 = time.perf_counter()
    for _ in range(args.repeats):
        host()
    rows["host transfers (inputs in, outputs out)"] = ((time.perf_counter() - t0) / args.repeats, 1)

    peak = dot_peak()
    whole = rows["whole decode program"][0]
    flops = model_flops(cfg, n, ctx)
    parts = sum(
        t * k
        for name, (t, k) in rows.items()
        if name != "whole decode program" and "comparison" not in name and "greedy" not in name
    )
    print(
        f"SmolLM2-135M f32, {n} rows at position {ctx}, cache {s} positions; jnp.dot peak "
        f"{peak / 1e9:.0f} GFLOP/s; model FLOPs per step {flops / 1e9:.2f} G"
    )
    print("| part | ms per call | calls per step | ms per step | share of the whole |")
    print("|---|---|---|---|---|")
    for name, (t, k) in rows.items():
        print(f"| {name} | {t * 1e3:.2f} | {k} | {t * k * 1e3:.1f} | {t * k / whole:.0%} |")
    print(f"| sum of the parts | | | {parts * 1e3:.1f} | {parts / whole:.0%} |")
    print(
        f"decode step: {whole * 1e3:.1f} ms = {flops / whole / 1e9:.0f} GFLOP/s = "
        f"{flops / whole / peak:.1%} of the jnp.dot peak"
    )
    Path(args.out).write_text(
        json.dumps(
            dict(
                rows=n,
                context=ctx,
                cache_positions=s,
                peak_flops=peak,
                model_flops=flops,
                parts={k: dict(seconds=t, per_step=c) for k, (t, c) in rows.items()},
                step_s=whole,
                fraction_of_peak=flops / whole / peak,
            ),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
