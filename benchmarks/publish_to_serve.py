"""A version from the trainer's push to every worker, through a real parameter server.

    .venv/bin/python benchmarks/publish_to_serve.py [GIB [MIB_S]]     # default 1 GiB, 200 MiB/s

This process runs a parameter server (``ParamServerService`` on loopback, ``param_server.fanout``
"relay") and pushes versions to it as the trainer does (``ParamServerClient.push``); 1 and 2
worker processes (``weight_sync.py worker``: a ``relay.RelayServer`` that receives a version in
a chain, checks it and uploads it to its CPU device, passing each bucket on) receive each one.
Every process's egress is held to MIB_S (the emulated NIC: the trainer's push, the parameter
server's relay, each worker's relay), so the network binds and not these 2 cores.

Baseline: the workers are asked for the version once the push has returned (the controller
before ``stage_early``; the parameter server reads the committed version from its store). Ours:
they are asked as the push starts (``controller/publishes.py`` ``stage_early`` with
``trainer.publish_in_flight``), and the parameter server relays the version as it arrives
(``service.CutThrough``). Publish to serve: from the push's start to the last worker's upload.
Limit: one transfer of the version at MIB_S (the push alone cannot be faster). Runs alternate,
each a new version; medians of ``ROUNDS``. Writes ``publish_to_serve.json`` next to this file.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.relay import Egress
from rlax_tpu.param_server.server import ParamServer
from rlax_tpu.param_server.service import ParamServerService, add_to_server
from rlax_tpu.rpc.transport import make_server

HERE = Path(__file__).resolve().parent
ROUNDS = 3
ARRAYS = 16


def _limited(client: ParamServerClient, egress: Egress) -> None:
    """The client's publish messages sent at the emulated NIC's rate."""
    plain = client._publish_stream

    def stream(header, datas):  # noqa: ANN001, ANN202
        for message in plain(header, datas):
            egress.take(len(message) if isinstance(message, bytes | memoryview) else 0)
            yield message

    client._publish_stream = stream


def _workers(n: int, rate: float) -> tuple[list, list[str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "weight_sync.py"), "worker", "-", str(rate)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
        )
        for _ in range(n)
    ]
    return procs, [json.loads(p.stdout.readline())["endpoint"] for p in procs]


def _ask(procs: list, endpoints: list[str], ps: str, version: int, n: int) -> None:
    for k in range(n):
        sources = [*([endpoints[k - 1]] if k else []), ps]
        job = {"version": version, "sources": sources, "arrays": ARRAYS}
        procs[k].stdin.write(json.dumps(job) + "\n")
        procs[k].stdin.flush()


def run(total_bytes: int, rate: float, counts: tuple[int, ...] = (1, 2)) -> dict:
    per = total_bytes // ARRAYS // 2
    rng = np.random.default_rng(0)
    tree = {
        f"w{i:02d}": rng.integers(0, 2**16, per, dtype=np.uint16).view(ml_dtypes.bfloat16)
        for i in range(ARRAYS)
    }
    nbytes = sum(a.nbytes for a in tree.values())
    config = ParamServerConfig(persist_every=0, fanout="relay", in_memory_versions=2)
    store = ParamServer(config)
    service = ParamServerService(
        store, chunk_bytes=config.chunk_bytes, relay_appear_s=30.0, cut_through=True
    )
    service.relay.egress = Egress(rate)  # the parameter server's NIC
    cut_through = store.receiving
    server, port = make_server(
        "127.0.0.1:0",
        lambda s: add_to_server(service, s),
        max_message_bytes=config.max_message_bytes,
        max_workers=16,
    )
    endpoint = f"127.0.0.1:{port}"
    client = ParamServerClient(endpoint, chunk_bytes=config.chunk_bytes, timeout_s=600)
    _limited(client, Egress(rate))
    procs, endpoints = _workers(max(counts), rate)
    out: dict = {"bytes": nbytes, "rate": rate, "limit_s": nbytes / rate, "runs": []}
    version = 0
    try:
        # Warm-up (the parameter server takes one tree a run): the workers' JAX runtimes, the
        # first touches of every buffer's memory.
        client.push(tree, version)
        _ask(procs, endpoints, endpoint, version, len(procs))
        for p in procs:
            p.stdout.readline()
        for _ in range(ROUNDS):
            for n in counts:
                for mode in ("after the push", "beside the push"):
                    version += 1
                    store.receiving = cut_through if mode == "beside the push" else None
                    start = time.time()
                    pushed: list[float] = []
                    pusher = threading.Thread(
                        target=lambda v=version, out=pushed: (
                            client.push(tree, v),
                            out.append(time.time()),
                        )
                    )
                    pusher.start()
                    if mode == "after the push":
                        pusher.join()
                    _ask(procs, endpoints, endpoint, version, n)
                    done = [json.loads(procs[k].stdout.readline())["done"] for k in range(n)]
                    pusher.join()
                    run_ = {
                        "mode": mode,
                        "workers": n,
                        "push_s": pushed[0] - start,
                        "publish_to_serve_s": max(done) - start,
                    }
                    out["runs"].append(run_)
                    print(
                        f"  {mode}, {n} worker(s): push {run_['push_s']:.2f} s, publish to serve "
                        f"{run_['publish_to_serve_s']:.2f} s",
                        flush=True,
                    )
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        client.close()
        server.stop(None)
        store.close()
    return out


def summary(r: dict) -> list[str]:
    rows = [
        "| workers | push s | publish to serve s: after the push (before) | beside the push "
        "(ours) | ours / before | ours / limit |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({x["workers"] for x in r["runs"]}):

        def med(mode: str, key: str, n: int = n) -> float:
            return statistics.median(
                x[key] for x in r["runs"] if x["workers"] == n and x["mode"] == mode
            )

        before, ours = (
            med("after the push", "publish_to_serve_s"),
            med("beside the push", "publish_to_serve_s"),
        )
        push = med("after the push", "push_s")
        rows.append(
            f"| {n} | {push:.2f} | {before:.2f} | {ours:.2f} | {ours / before:.2f} | "
            f"{ours / r['limit_s']:.2f} |"
        )
    return rows


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    mib_s = float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
    r = run(int(gib * 2**30), mib_s * 2**20)
    print(
        f"{r['bytes'] / 2**30:.2f} GiB, every process's egress {mib_s:.0f} MiB/s: one transfer "
        f"(the limit) {r['limit_s']:.2f} s; medians of {ROUNDS}"
    )
    print("\n".join(summary(r)))
    (HERE / "publish_to_serve.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
