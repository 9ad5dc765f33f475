"""Bytes and time per host of a shard-aligned weight pull against a whole pull, in one run.

    .venv/bin/python benchmarks/sharded_pull.py

A worker whose mesh spans several hosts pulls on each host only the slices that host's devices
hold (``param_server.client.needed_slices``, what ``ParamServerClient.pull`` fetches with the
engine's shardings). Here one process plays every host in turn: 8 forced CPU devices split into
hosts of 2 or 4, each host's slices pulled through a real parameter server on 127.0.0.1 (the
server counts the bytes it sends). Baseline: every host pulling the whole version, as before
shard-aligned pulls. Physical limit, measured in the same run: opaque bytes streamed down the
same loopback gRPC transport (benchmarks/param_server_throughput.py's RawStream). Model: a Llama
shape with 16 query / 8 KV heads, published in bf16. Writes JSON next to this file.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlax_tpu import models  # noqa: E402
from rlax_tpu.config import MeshConfig, ParamServerConfig  # noqa: E402
from rlax_tpu.param_server.client import ParamServerClient, needed_slices  # noqa: E402
from rlax_tpu.param_server.service import serve  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from param_server_throughput import RawStream  # noqa: E402

MODEL = models.preset(
    "tiny",
    vocab_size=32_000,
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=12,
    num_heads=16,
    num_kv_heads=8,
    max_position_embeddings=4096,
)
# (mesh, devices per host): the mesh over all 8 devices, hosts taking consecutive devices.
LAYOUTS = {
    "tensor 4 over 2 hosts x 2": (MeshConfig(data=1, fsdp=1, tensor=4), 2),
    "tensor 8 over 2 hosts x 4": (MeshConfig(data=1, fsdp=1, tensor=8), 4),
    "tensor 8 over 4 hosts x 2": (MeshConfig(data=1, fsdp=1, tensor=8), 2),
    "data 2 x tensor 4 over 2 hosts x 4": (MeshConfig(data=2, fsdp=1, tensor=4), 4),
}
REPS = 3


def published_tree() -> dict:
    """The model's parameters as the trainer publishes them (pure dict, bf16 numpy)."""
    state = nnx.to_pure_dict(nnx.state(models.init_model(MODEL, seed=0)))
    return jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), state)


def shardings_on(mesh_cfg: MeshConfig) -> dict:
    """The inference engine's parameter shardings for ``mesh_cfg`` over the 8 devices."""
    mesh = models.make_mesh(mesh_cfg, jax.devices()[: mesh_cfg.data * mesh_cfg.tensor])
    abstract = nnx.state(models.abstract_model(MODEL))
    return nnx.to_pure_dict(models.param_shardings(abstract, mesh))


def timed_pull(client: ParamServerClient, store, boxes: list | None) -> tuple[float, int]:
    served = store.bytes_served()
    start = time.perf_counter()
    client.pull_arrays(0, boxes)
    return time.perf_counter() - start, store.bytes_served() - served


def main() -> None:
    tree = published_tree()
    whole = sum(a.nbytes for a in jax.tree.leaves(tree))
    config = ParamServerConfig(persist_every=0)
    server, port, store = serve(config)
    client = ParamServerClient(f"127.0.0.1:{port}", chunk_bytes=config.chunk_bytes)
    client.push(tree, 0)
    raw = RawStream(whole, config.chunk_bytes, config.max_message_bytes)
    manifest = client._manifest(0)
    raw_s, whole_s = [], []
    for _ in range(REPS):  # alternate baseline and limit so both see the same machine load
        raw_s.append(raw.round()["down_s"])
        seconds, nbytes = timed_pull(client, store, None)
        assert nbytes == whole
        whole_s.append(seconds)
    results = {}
    for name, (mesh_cfg, per_host) in LAYOUTS.items():
        shardings = shardings_on(mesh_cfg)
        devices = jax.devices()[: mesh_cfg.data * mesh_cfg.tensor]
        hosts = [devices[i : i + per_host] for i in range(0, len(devices), per_host)]
        per = []
        for host in hosts:
            boxes = needed_slices(manifest, shardings, host)
            times = []
            for _ in range(REPS):
                seconds, nbytes = timed_pull(client, store, boxes)
                times.append(seconds)
            per.append({"bytes": nbytes, "seconds": statistics.median(times)})
        results[name] = {"hosts": len(hosts), "per_host": per}
    raw.close()
    client.close()
    server.stop(None)
    store.close()
    limit_bps = whole / statistics.median(raw_s)
    whole_bps = whole / statistics.median(whole_s)
    print(
        f"model: {whole / 2**20:.0f} MiB of bf16 weights ({MODEL.num_heads} q / "
        f"{MODEL.num_kv_heads} KV heads); loopback gRPC limit {limit_bps / 2**30:.2f} GiB/s; "
        f"whole pull {statistics.median(whole_s):.3f} s ({whole_bps / limit_bps:.2f} of the limit)"
    )
    rows = [
        "| layout | bytes per host (max) | vs whole pull | pull time per host (max) | "
        "vs whole pull | fraction of loopback limit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        nbytes = max(h["bytes"] for h in r["per_host"])
        seconds = max(h["seconds"] for h in r["per_host"])
        frac = nbytes / seconds / limit_bps
        rows.append(
            f"| {name} | {nbytes / 2**20:.0f} MiB | {nbytes / whole:.2f} | {seconds:.3f} s "
            f"| {seconds / statistics.median(whole_s):.2f} | {frac:.2f} |"
        )
    print("\n".join(rows))
    (HERE / "sharded_pull.json").write_text(
        json.dumps(
            {
                "whole_bytes": whole,
                "loopback_limit_bytes_per_s": limit_bps,
                "whole_pull_s": statistics.median(whole_s),
                "layouts": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
