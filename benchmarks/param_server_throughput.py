"""Parameter-server throughput against the raw loopback gRPC byte stream, in one run.

    python benchmarks/param_server_throughput.py [--out benchmarks/param_server_throughput.json]

Baseline (the physical limit here): the same gRPC transport (rpc.transport, same chunk size and
message limits) streaming opaque bytes up and down, with nothing done to them. Ours: push and
pull of a SmolLM2-135M-shaped pytree (30 layers, hidden 576, intermediate 1536, 9 heads / 3 kv
heads, vocab 49152, tied embeddings: 134.5M parameters) in bf16 and f32 through a real server on
127.0.0.1: checksums, TensorStore writes and reads, manifest commit, jax.Array assembly. Pulls run
with 1 and 4 concurrent pullers. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import grpc
import jax
import ml_dtypes
import numpy as np

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.service import serve
from rlax_tpu.rpc.transport import make_channel, make_server

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 30, 576, 1536, 9, 3, 49152
ANCHORS = {"verl, 7B on GPUs": 0.02, "TRL, 0.6B": 0.18}  # seconds per weight sync, as published


def smollm2_135m(dtype: np.dtype, seed: int = 0) -> dict:
    """Synthetic weights with SmolLM2-135M's shapes (random values: nothing compresses)."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    layer = lambda: {
        "attn": {"q": w(HIDDEN, HEADS * head_dim), "k": w(HIDDEN, KV_HEADS * head_dim),
                 "v": w(HIDDEN, KV_HEADS * head_dim), "o": w(HEADS * head_dim, HIDDEN)},
        "mlp": {"gate": w(HIDDEN, INTERMEDIATE), "up": w(HIDDEN, INTERMEDIATE),
                "down": w(INTERMEDIATE, HIDDEN)},
        "input_norm": w(HIDDEN), "post_attn_norm": w(HIDDEN),
    }  # fmt: skip
    return {
        "embed": w(VOCAB, HIDDEN),
        "layers": [layer() for _ in range(LAYERS)],
        "norm": w(HIDDEN),
    }


# ------------------------------------------------------------------------------------ raw gRPC


def raw_stream_seconds(nbytes: int, chunk_bytes: int, max_message_bytes: int, reps: int) -> dict:
    """Median seconds to stream ``nbytes`` of opaque bytes up (client->server) and down."""
    payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    view = memoryview(payload)

    def up(it, ctx):  # noqa: ANN001, ANN202
        return str(sum(len(m) for m in it)).encode()

    def down(req, ctx):  # noqa: ANN001, ANN202
        for i in range(0, nbytes, chunk_bytes):
            yield view[i : i + chunk_bytes].tobytes()

    def add(server: grpc.Server) -> None:
        handlers = {"Up": grpc.stream_unary_rpc_method_handler(up),
                    "Down": grpc.unary_stream_rpc_method_handler(down)}  # fmt: skip
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Raw", handlers),)
        )

    server, port = make_server("127.0.0.1:0", add, max_message_bytes=max_message_bytes)
    channel = make_channel(f"127.0.0.1:{port}", max_message_bytes=max_message_bytes)
    upload, download = (
        channel.stream_unary("/bench.Raw/Up"),
        channel.unary_stream("/bench.Raw/Down"),
    )
    ups, downs = [], []
    try:
        for _ in range(reps + 1):  # the first round warms up
            t = time.perf_counter()
            got = upload(view[i : i + chunk_bytes].tobytes() for i in range(0, nbytes, chunk_bytes))
            ups.append(time.perf_counter() - t)
            assert int(got) == nbytes
            t = time.perf_counter()
            assert sum(len(m) for m in download(b"")) == nbytes
            downs.append(time.perf_counter() - t)
    finally:
        channel.close()
        server.stop(None)
    return {"up_s": statistics.median(ups[1:]), "down_s": statistics.median(downs[1:])}


# ------------------------------------------------------------------------------------ ours


def ours_seconds(
    tree: dict, config: ParamServerConfig, reps: int, pullers: tuple[int, ...]
) -> dict:
    """Median seconds of push, and of pull with n concurrent pullers (slowest of them)."""
    server, port, store = serve(config)
    endpoint = f"127.0.0.1:{port}"
    clients = [ParamServerClient(endpoint, chunk_bytes=config.chunk_bytes,
                                 max_message_bytes=config.max_message_bytes)
               for _ in range(max(pullers))]  # fmt: skip
    pushes, pulls = [], {n: [] for n in pullers}
    try:
        for version in range(reps + 1):
            t = time.perf_counter()
            clients[0].push(tree, version)
            pushes.append(time.perf_counter() - t)
            for n in pullers:
                barrier = threading.Barrier(n)

                def pull(client: ParamServerClient, version: int = version,
                         barrier: threading.Barrier = barrier) -> None:  # fmt: skip
                    barrier.wait()
                    out = client.pull(version)
                    jax.block_until_ready(out)

                threads = [threading.Thread(target=pull, args=(c,)) for c in clients[:n]]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                pulls[n].append(time.perf_counter() - t)
        check = clients[0].pull_arrays(reps)[1][0]  # crc-verified whole arrays
        assert check.tobytes() == tree["embed"].tobytes()
    finally:
        for c in clients:
            c.close()
        server.stop(None)
        store.close()
    return {"push_s": statistics.median(pushes[1:]),
            **{f"pull_{n}_s": statistics.median(v[1:]) for n, v in pulls.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).with_name("param_server_throughput.json"))
    )
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    config = ParamServerConfig(persist_every=0)
    rows, results = [], {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                         "chunk_bytes": config.chunk_bytes, "cases": []}  # fmt: skip
    for dtype in (ml_dtypes.bfloat16, np.float32):
        tree = smollm2_135m(np.dtype(dtype))
        leaves = jax.tree_util.tree_leaves(tree)
        nbytes, params = sum(x.nbytes for x in leaves), sum(x.size for x in leaves)
        raw = raw_stream_seconds(nbytes, config.chunk_bytes, config.max_message_bytes, args.reps)
        ours = ours_seconds(tree, config, args.reps, pullers=(1, 4))
        raw_rt = raw["up_s"] + raw["down_s"]
        ours_rt = ours["push_s"] + ours["pull_1_s"]
        case = {"dtype": np.dtype(dtype).name, "params": params, "bytes": nbytes, **raw, **ours,
                "fraction_of_raw": raw_rt / ours_rt}  # fmt: skip
        results["cases"].append(case)
        gbps = lambda s, n=1, nbytes=nbytes: n * nbytes / s / 1e9
        rows += [
            f"| {case['dtype']} | raw gRPC up + down (baseline) | {raw_rt:.2f} | "
            f"{gbps(raw['up_s']):.2f} up, {gbps(raw['down_s']):.2f} down | 100% |",
            f"| {case['dtype']} | push (publish) | {ours['push_s']:.2f} | {gbps(ours['push_s']):.2f} | "
            f"{raw['up_s'] / ours['push_s']:.0%} of raw up |",
            f"| {case['dtype']} | pull, 1 puller | {ours['pull_1_s']:.2f} | {gbps(ours['pull_1_s']):.2f} | "
            f"{raw['down_s'] / ours['pull_1_s']:.0%} of raw down |",
            f"| {case['dtype']} | pull, 4 concurrent pullers | {ours['pull_4_s']:.2f} | "
            f"{gbps(ours['pull_4_s'], 4):.2f} aggregate | |",
            f"| {case['dtype']} | **push + pull of one version** | **{ours_rt:.2f}** | "
            f"{gbps(ours_rt):.2f} | **{case['fraction_of_raw']:.0%}** of raw |",
        ]
        del tree, leaves
    print(f"\nSmolLM2-135M-shaped pytree ({results['cases'][0]['params'] / 1e6:.1f}M params), "
          f"{results['machine']}, loopback gRPC, chunks of {config.chunk_bytes >> 20} MiB\n")  # fmt: skip
    print("| dtype | what | seconds | GB/s | fraction |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nAnchors (seconds per weight sync, published): "
          + ", ".join(f"{k} ~{v} s" for k, v in ANCHORS.items()))  # fmt: skip
    results["anchors_s"] = ANCHORS
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
