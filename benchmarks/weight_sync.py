"""A new version from the trainer to the inference engines: the paths, against their limits.

    .venv/bin/python benchmarks/weight_sync.py

(a) One host (a single TPU VM's layout, ``topology.trainer_devices``): 8 forced CPU devices, the
trainer's mesh on devices 0-3 (fsdp 4), one worker's engine on 4-7 (tensor 4), a Llama-shaped
model in bf16. Limit: a bare ``jax.device_put`` of the trainer's tree to the engine's shardings.
Ours: the trainer's push into ``controller.handoff.DeviceHandoff`` and the worker's fetch, timed
after the background copy to the parameter server finished (on a TPU that copy leaves over PCIe
and the host, not over ICI, which the transfer uses; on these 2 cores it competes for the same
CPU, so the fetch beside it is reported too). Baseline: the path before it, the trainer pushing
through loopback gRPC into a real parameter server and the worker pulling from it. The bytes the
parameter server serves during the hand-off are counted (zero expected).

(c) Delta bytes per version over consecutive versions of a real run:

    .venv/bin/python -m rlax_tpu.controller --config=configs/smollm2_math.py:cpu \
        --config.controller.run_dir=RUN --config.controller.num_steps=21 \
        --config.trainer.checkpoint_every=1 --config.trainer.keep_checkpoints=30 \
        --config.data.eval_every=0
    .venv/bin/python benchmarks/weight_sync.py deltas RUN

reads the trainer's checkpoints (the float32 masters of every version), casts each to the
published dtypes (float32, bf16: the trainer's cast, round to nearest even) and encodes every
version against the one before with ``param_server/delta.py`` (each array the smallest of
unchanged / changed entries / changed 4 KiB chunks / whole), checking the rebuilt version bitwise.

Part (b) (several processes, an emulated NIC, fan-out to 1, 2 and 4 workers) of [weight-sync] is
not built yet.

Writes JSON next to this file.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlax_tpu import models  # noqa: E402
from rlax_tpu.config import MeshConfig, ParamServerConfig  # noqa: E402
from rlax_tpu.controller.handoff import DeviceHandoff  # noqa: E402
from rlax_tpu.param_server.client import ParamServerClient, PulledWeights  # noqa: E402
from rlax_tpu.param_server.service import serve  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = models.preset(
    "tiny",
    vocab_size=32_000,
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=24,
    num_heads=16,
    num_kv_heads=8,
    max_position_embeddings=4096,
)
REPS = 9


def shardings(mesh_cfg: MeshConfig, devices: list) -> dict:
    """The model's parameter shardings (pure dict) for ``mesh_cfg`` over ``devices``."""
    mesh = models.make_mesh(mesh_cfg, devices)
    return nnx.to_pure_dict(models.param_shardings(nnx.state(models.abstract_model(MODEL)), mesh))


def trainer_tree(where: dict) -> dict:
    """The trainer's published cast: bf16 arrays on the trainer's shardings."""
    state = nnx.to_pure_dict(nnx.state(models.init_model(MODEL, seed=0)))
    return jax.block_until_ready(
        jax.tree.map(lambda a, s: jax.device_put(a.astype(jnp.bfloat16), s), state, where)
    )


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def one_host() -> dict:
    devices = jax.devices()
    tree = trainer_tree(shardings(MeshConfig(data=1, fsdp=4, tensor=1), devices[:4]))
    engine = shardings(MeshConfig(data=1, fsdp=1, tensor=4), devices[4:])
    nbytes = sum(a.nbytes for a in jax.tree.leaves(tree))
    config = ParamServerConfig(persist_every=0, in_memory_versions=4)
    server, port, store = serve(config)
    client = ParamServerClient(f"127.0.0.1:{port}", chunk_bytes=config.chunk_bytes)
    handoff = DeviceHandoff(client, keep=1)
    source = handoff.source(engine, PulledWeights(client, engine))
    pulled = PulledWeights(client, engine)
    bare, path, beside, old, push_s, served = [], [], [], [], [], []
    version = 0
    timed(lambda: jax.device_put(tree, engine))  # compile/warm the transfer once
    for _ in range(REPS):  # alternate so each sees the same machine load
        bare.append(timed(lambda: jax.device_put(tree, engine)))
        version += 1
        push_s.append(timed(lambda v=version: handoff.push(tree, v)))
        handoff.flush()
        before = store.bytes_served()
        path.append(push_s[-1] + timed(lambda v=version: source.fetch(v)))
        served.append(store.bytes_served() - before)
        version += 1
        handoff.push(tree, version)  # its copy to the parameter server starts now
        beside.append(timed(lambda v=version: source.fetch(v)))
        handoff.flush()
        version += 1
        old.append(
            timed(lambda v=version: client.push(tree, v)) + timed(lambda v=version: pulled.fetch(v))
        )
    handoff.close()
    client.close()
    server.stop(None)
    store.close()
    med = {
        k: statistics.median(v)
        for k, v in {
            "bare": bare,
            "path": path,
            "beside": beside,
            "old": old,
            "push": push_s,
        }.items()
    }
    return {
        "bytes": nbytes,
        "bare_device_put_s": med["bare"],
        "handoff_s": med["path"],
        "handoff_push_s": med["push"],
        "handoff_beside_copy_s": med["beside"],
        "grpc_push_and_pull_s": med["old"],
        "bytes_served_during_handoff": max(served),
        "handoff_vs_bare": med["path"] / med["bare"],
        "grpc_vs_bare": med["old"] / med["bare"],
        "device_loads": handoff.counts["device_loads"],
        "server_loads": handoff.counts["server_loads"],
    }


def _masters(run_dir: Path) -> dict[int, list]:
    """{version: the model's float32 master arrays (sorted by path)} from the trainer's
    checkpoints under ``run_dir``."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.fspath(run_dir / "trainer"))
    out = {}
    for step in sorted(manager.all_steps()):
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))[
            "state"
        ]
        leaves = jax.tree_util.tree_leaves_with_path(state["params"]["model"])
        out[step] = [np.asarray(x) for _, x in sorted(leaves, key=lambda kv: str(kv[0]))]
    manager.close()
    return out


def deltas(run_dir: Path) -> dict:
    from rlax_tpu.param_server.delta import apply_tree, encode_tree

    masters = _masters(run_dir)
    versions = sorted(masters)
    if len(versions) < 2:
        raise SystemExit(f"{run_dir}: fewer than two checkpoints ({versions})")
    gaps = [b - a for a, b in itertools.pairwise(versions)]
    if set(gaps) != {1}:
        raise SystemExit(f"{run_dir}: checkpoints are not of consecutive versions ({versions})")
    out = {}
    for name, dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        cast = {v: [a.astype(dtype) for a in masters[v]] for v in versions}
        full = sum(a.nbytes for a in cast[versions[0]])
        rows = []
        for prev, v in itertools.pairwise(versions):
            delta = encode_tree(cast[prev], cast[v], base_version=prev)
            rebuilt = apply_tree(cast[prev], delta)
            assert all(a.tobytes() == b.tobytes() for a, b in zip(rebuilt, cast[v], strict=True))
            changed = sum(
                int(np.count_nonzero(a.view(f"u{a.itemsize}") != b.view(f"u{b.itemsize}")))
                for a, b in zip(cast[prev], cast[v], strict=True)
            )
            elems = sum(a.size for a in cast[v])
            rows.append(
                {
                    "version": v,
                    "delta_bytes": delta.nbytes,
                    "ratio": delta.nbytes / full,
                    "changed_fraction": changed / elems,
                    "kinds": delta.kinds(),
                }
            )
        out[name] = {"full_bytes": full, "versions": rows}
    return out


def print_deltas(d: dict) -> None:
    for name, r in d.items():
        ratios = [x["ratio"] for x in r["versions"]]
        changed = [x["changed_fraction"] for x in r["versions"]]
        print(
            f"(c) {name}: {len(ratios)} versions, full {r['full_bytes'] / 2**20:.1f} MiB; "
            f"delta/full median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max "
            f"{max(ratios):.4f}); values changed median {statistics.median(changed):.4f}"
        )
        print(
            "| version | delta MiB | delta / full | values changed | arrays same/entries/chunks/full |"
        )
        print("|---:|---:|---:|---:|---|")
        for x in r["versions"]:
            k = x["kinds"]
            print(
                f"| {x['version']} | {x['delta_bytes'] / 2**20:.2f} | {x['ratio']:.4f} | "
                f"{x['changed_fraction']:.4f} | {k['same']}/{k['entries']}/{k['chunks']}/{k['full']} |"
            )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "deltas":
        d = deltas(Path(sys.argv[2]))
        print_deltas(d)
        (HERE / "weight_sync_deltas.json").write_text(json.dumps(d, indent=2))
        return
    if len(sys.argv) != 1:
        raise SystemExit(
            "usage: weight_sync.py            (part a: one host)\n"
            "       weight_sync.py deltas RUN (part c: a run's checkpoints)"
        )
    a = one_host()
    gib = a["bytes"] / 2**30
    print(
        f"(a) one host: {gib:.2f} GiB of bf16 weights, trainer fsdp 4 on devices 0-3 -> "
        f"engine tensor 4 on devices 4-7 (median of {REPS})"
    )
    rows = [
        "| path | seconds | vs bare device_put | GiB/s |",
        "|---|---:|---:|---:|",
    ]
    for name, key in (
        ("bare jax.device_put (limit)", "bare_device_put_s"),
        ("hand-off: push + fetch (ours)", "handoff_s"),
        ("hand-off fetch beside the background copy", "handoff_beside_copy_s"),
        ("gRPC push + pull via the parameter server (before)", "grpc_push_and_pull_s"),
    ):
        s = a[key]
        rows.append(f"| {name} | {s:.3f} | {s / a['bare_device_put_s']:.2f} | {gib / s:.2f} |")
    print("\n".join(rows))
    print(
        f"bytes the parameter server served during the hand-off: "
        f"{a['bytes_served_during_handoff']}; loads: {a['device_loads']} device to device, "
        f"{a['server_loads']} from the parameter server"
    )
    (HERE / "weight_sync.json").write_text(json.dumps({"one_host": a}, indent=2))


if __name__ == "__main__":
    main()
