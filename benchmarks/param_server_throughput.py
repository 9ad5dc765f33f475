"""Parameter-server throughput against the raw loopback gRPC byte stream, in one run.

    python benchmarks/param_server_throughput.py [--out benchmarks/param_server_throughput.json]

Baseline (the physical limit here): the same gRPC transport (rpc.transport, same chunk size and
message limits) streaming opaque bytes up and down, with nothing done to them. Ours: push and
pull of a SmolLM2-135M-shaped pytree (30 layers, hidden 576, intermediate 1536, 9 heads / 3 kv
heads, vocab 49152, tied embeddings: 134.5M parameters) in bf16 and f32 through a real server on
127.0.0.1: CRC32C checksums, TensorStore writes and reads, manifest commit, jax.Array assembly.
Pulls run with 1 and 4 concurrent pullers. Baseline and ours alternate round by round, so both
see the same load on a shared machine. The headline is the median of rounds 1-5 (versions 1-5,
after a warm-up round); while it holds fewer than in_memory_versions (4) versions, the server
needs new memory for each one. Four more rounds follow, and "steady state" is the median of every
round from version 5 on, whose publish lands in the memory of a version the server collected (as
every publish of a training run does after its first five). Prints a markdown table, writes JSON.
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
        "attn": {
            "q": w(HIDDEN, HEADS * head_dim),
            "k": w(HIDDEN, KV_HEADS * head_dim),
            "v": w(HIDDEN, KV_HEADS * head_dim),
            "o": w(HEADS * head_dim, HIDDEN),
        },
        "mlp": {
            "gate": w(HIDDEN, INTERMEDIATE),
            "up": w(HIDDEN, INTERMEDIATE),
            "down": w(INTERMEDIATE, HIDDEN),
        },
        "input_norm": w(HIDDEN),
        "post_attn_norm": w(HIDDEN),
    }
    return {
        "embed": w(VOCAB, HIDDEN),
        "layers": [layer() for _ in range(LAYERS)],
        "norm": w(HIDDEN),
    }


# ------------------------------------------------------------------------------------ raw gRPC


class RawStream:
    """The baseline: opaque bytes streamed up (client->server) and down over rpc.transport."""

    def __init__(self, nbytes: int, chunk_bytes: int, max_message_bytes: int):
        self.nbytes, self.chunk_bytes = nbytes, chunk_bytes
        payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        self._view = view = memoryview(payload)

        def up(it, ctx):  # noqa: ANN001, ANN202
            return str(sum(len(m) for m in it)).encode()

        def down(req, ctx):  # noqa: ANN001, ANN202
            for i in range(0, nbytes, chunk_bytes):
                yield view[i : i + chunk_bytes].tobytes()

        def add(server: grpc.Server) -> None:
            handlers = {
                "Up": grpc.stream_unary_rpc_method_handler(up),
                "Down": grpc.unary_stream_rpc_method_handler(down),
            }
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("bench.Raw", handlers),)
            )

        self._server, port = make_server("127.0.0.1:0", add, max_message_bytes=max_message_bytes)
        self._channel = make_channel(f"127.0.0.1:{port}", max_message_bytes=max_message_bytes)
        self._up = self._channel.stream_unary("/bench.Raw/Up")
        self._down = self._channel.unary_stream("/bench.Raw/Down")

    def round(self) -> dict:
        """Seconds to stream the bytes up, and down."""
        n, view = self.chunk_bytes, self._view
        t = time.perf_counter()
        got = self._up(view[i : i + n].tobytes() for i in range(0, self.nbytes, n))
        up = time.perf_counter() - t
        assert int(got) == self.nbytes
        t = time.perf_counter()
        assert sum(len(m) for m in self._down(b"")) == self.nbytes
        return {"up_s": up, "down_s": time.perf_counter() - t}

    def close(self) -> None:
        self._channel.close()
        self._server.stop(None)


# ------------------------------------------------------------------------------------ ours


class Ours:
    """A real parameter server on 127.0.0.1: push of a new version, then n concurrent pulls."""

    def __init__(self, tree: dict, config: ParamServerConfig, pullers: tuple[int, ...]):
        self.tree, self.pullers, self.version = tree, pullers, 0
        self._server, port, self._store = serve(config)
        self._clients = [
            ParamServerClient(
                f"127.0.0.1:{port}",
                chunk_bytes=config.chunk_bytes,
                max_message_bytes=config.max_message_bytes,
            )
            for _ in range(max(pullers))
        ]

    def round(self) -> dict:
        """Seconds of one push, and of pulls by n concurrent pullers (until the slowest ends)."""
        out = {}
        t = time.perf_counter()
        self._clients[0].push(self.tree, self.version)
        out["push_s"] = time.perf_counter() - t
        for n in self.pullers:
            barrier = threading.Barrier(n)

            def pull(
                client: ParamServerClient,
                version: int = self.version,
                barrier: threading.Barrier = barrier,
            ) -> None:
                barrier.wait()
                jax.block_until_ready(client.pull(version))

            threads = [threading.Thread(target=pull, args=(c,)) for c in self._clients[:n]]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            out[f"pull_{n}_s"] = time.perf_counter() - t
        self.version += 1
        return out

    def check(self) -> None:
        got = self._clients[0].pull_arrays(self.version - 1)[1][0]  # checksum-verified arrays
        assert got.tobytes() == self.tree["embed"].tobytes()

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._server.stop(None)
        self._store.close()


def _summary(rounds: list[dict]) -> dict:
    fractions = [(r["up_s"] + r["down_s"]) / (r["push_s"] + r["pull_1_s"]) for r in rounds]
    return {
        **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "fraction_of_raw": statistics.median(fractions),
        "fraction_of_raw_rounds": fractions,
    }


def measure(tree: dict, config: ParamServerConfig, reps: int, steady_reps: int) -> dict:
    """Medians over ``reps`` rounds (after a warm-up round) that alternate the baseline and ours,
    so that both see the same load on a shared machine; ``fraction_of_raw`` is the median of
    each round's (raw up + raw down) / (push + pull).

    Round i publishes version i. Up to version K = in_memory_versions the server holds every
    version it received and needs new memory for each; from version K + 1 on, a publish lands in
    the memory of a version it collected (as every publish of a run does after its first K + 1).
    ``steady_reps`` more rounds follow; ``steady_state`` summarizes all rounds past version K."""
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    raw = RawStream(nbytes, config.chunk_bytes, config.max_message_bytes)
    ours = Ours(tree, config, pullers=(1, 4))
    rounds = []
    try:
        for _ in range(1 + reps + steady_reps):
            rounds.append({**raw.round(), **ours.round()})
        ours.check()
    finally:
        raw.close()
        ours.close()
    steady = rounds[config.in_memory_versions + 1 :]
    return {
        **_summary(rounds[1 : 1 + reps]),
        "steady_state": {"from_version": config.in_memory_versions + 1, **_summary(steady)}
        if steady
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).with_name("param_server_throughput.json"))
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steady_reps", type=int, default=4)
    args = parser.parse_args()
    config = ParamServerConfig(persist_every=0)
    rows, results = (
        [],
        {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "chunk_bytes": config.chunk_bytes,
            "reps": args.reps,
            "steady_reps": args.steady_reps,
            "in_memory_versions": config.in_memory_versions,
            "load_average_start": os.getloadavg(),
            "cases": [],
        },
    )
    for dtype in (ml_dtypes.bfloat16, np.float32):
        tree = smollm2_135m(np.dtype(dtype))
        leaves = jax.tree_util.tree_leaves(tree)
        nbytes, params = sum(x.nbytes for x in leaves), sum(x.size for x in leaves)
        m = measure(tree, config, args.reps, args.steady_reps)
        raw_rt = m["up_s"] + m["down_s"]
        ours_rt = m["push_s"] + m["pull_1_s"]
        case = {"dtype": np.dtype(dtype).name, "params": params, "bytes": nbytes, **m}
        results["cases"].append(case)
        gbps = lambda s, n=1, nbytes=nbytes: n * nbytes / s / 1e9
        rows += [
            f"| {case['dtype']} | raw gRPC up + down (baseline) | {raw_rt:.2f} | "
            f"{gbps(m['up_s']):.2f} up, {gbps(m['down_s']):.2f} down | 100% |",
            f"| {case['dtype']} | push (publish) | {m['push_s']:.2f} | {gbps(m['push_s']):.2f} | "
            f"{m['up_s'] / m['push_s']:.0%} of raw up |",
            f"| {case['dtype']} | pull, 1 puller | {m['pull_1_s']:.2f} | {gbps(m['pull_1_s']):.2f} | "
            f"{m['down_s'] / m['pull_1_s']:.0%} of raw down |",
            f"| {case['dtype']} | pull, 4 concurrent pullers | {m['pull_4_s']:.2f} | "
            f"{gbps(m['pull_4_s'], 4):.2f} aggregate | |",
            f"| {case['dtype']} | **push + pull of one version** | **{ours_rt:.2f}** | "
            f"{gbps(ours_rt):.2f} | **{case['fraction_of_raw']:.0%}** of raw (rounds: "
            + ", ".join(f"{f:.0%}" for f in case["fraction_of_raw_rounds"])
            + ") |",
        ]
        if (st := m["steady_state"]) is not None:
            rows.append(
                f"| {case['dtype']} | push + pull, steady state (versions >= "
                f"{st['from_version']}) | {st['push_s'] + st['pull_1_s']:.2f} | "
                f"{gbps(st['push_s'] + st['pull_1_s']):.2f} | {st['fraction_of_raw']:.0%} of raw "
                "(rounds: " + ", ".join(f"{f:.0%}" for f in st["fraction_of_raw_rounds"]) + ") |"
            )
        del tree, leaves
    print(
        f"\nSmolLM2-135M-shaped pytree ({results['cases'][0]['params'] / 1e6:.1f}M params), "
        f"{results['machine']}, loopback gRPC, chunks of {config.chunk_bytes >> 20} MiB\n"
    )
    print("| dtype | what | seconds | GB/s | fraction |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(
        "\nAnchors (seconds per weight sync, published): "
        + ", ".join(f"{k} ~{v} s" for k, v in ANCHORS.items())
    )
    results["anchors_s"] = ANCHORS
    results["load_average_end"] = os.getloadavg()
    print(
        f"load average (1, 5, 15 min): {results['load_average_start']} at the start, "
        f"{results['load_average_end']} at the end"
    )
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
