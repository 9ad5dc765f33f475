"""A new version from the trainer to the inference engines: the paths, against their limits.

    .venv/bin/python benchmarks/weight_sync.py                 # (a)
    .venv/bin/python benchmarks/weight_sync.py fanout          # (b)
    .venv/bin/python benchmarks/weight_sync.py deltas RUN      # (c), RUN as below

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
Then the bf16 cast against bases 2, 4, 8 and 16 versions older (``gaps``): a worker that reloads
every η_r versions holds a base that old.

(b) Several processes on loopback (``fanout``): a publisher (this process: a ``relay.Publisher``
filling its buffer from host arrays, as the trainer's host would) and 1, 2 and 4 worker processes,
each a ``relay.RelayServer`` that receives the version (``relay.fetch_to_device``: received,
checked and uploaded to its CPU device in overlap) and passes it on. First with every process's
egress held to a fixed rate (``relay.Egress``, the emulated NIC, so the network and not these
2 cores binds), then without. Ours: the workers in a chain (worker k reads from worker k-1, the
first from the publisher). Baseline: a star (every worker reads from the publisher, as every
worker pulls from the parameter server today). Limit without the NIC: raw bytes streamed over
loopback gRPC from this process to a worker process, in the same run. (Runs relay through
the parameter server with ``param_server.fanout=relay``: ``param_server/relay.py``.)

Writes JSON next to this file.
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
STEADY_VERSIONS = 8


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


def _masters(run_dir: Path):
    """(version, the model's float32 master arrays sorted by path) from the trainer's
    checkpoints under ``run_dir``, one version at a time."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.fspath(run_dir / "trainer"))
    try:
        for step in sorted(manager.all_steps()):
            state = manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore())
            )["state"]
            leaves = jax.tree_util.tree_leaves_with_path(state["params"]["model"])
            yield step, [np.asarray(x) for _, x in sorted(leaves, key=lambda kv: str(kv[0]))]
            del state, leaves
    finally:
        manager.close()


def deltas(run_dir: Path) -> dict:
    from rlax_tpu.param_server.delta import apply_tree, encode_tree

    dtypes = (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16))
    out: dict = {name: {"full_bytes": 0, "versions": []} for name, _ in dtypes}
    out["bfloat16_gaps"] = {str(g): [] for g in GAPS}
    prev_version, prev = None, {}
    older: dict[int, list[np.ndarray]] = {}  # the bf16 casts of the last max(GAPS) versions
    for version, masters in _masters(run_dir):
        cast = {name: [a.astype(dtype) for a in masters] for name, dtype in dtypes}
        del masters
        if prev_version is not None and version != prev_version + 1:
            raise SystemExit(f"{run_dir}: checkpoints {prev_version} and {version} not consecutive")
        for name, _ in dtypes:
            new = cast[name]
            full = sum(a.nbytes for a in new)
            out[name]["full_bytes"] = full
            if prev_version is None:
                continue
            delta = encode_tree(prev[name], new, base_version=prev_version)
            rebuilt = apply_tree(prev[name], delta)
            assert all(a.tobytes() == b.tobytes() for a, b in zip(rebuilt, new, strict=True))
            del rebuilt
            changed = sum(
                int(np.count_nonzero(a.view(f"u{a.itemsize}") != b.view(f"u{b.itemsize}")))
                for a, b in zip(prev[name], new, strict=True)
            )
            out[name]["versions"].append(
                {
                    "version": version,
                    "delta_bytes": delta.nbytes,
                    "ratio": delta.nbytes / full,
                    "changed_fraction": changed / sum(a.size for a in new),
                    "kinds": delta.kinds(),
                }
            )
        for gap in GAPS:
            base = older.get(version - gap)
            if base is not None:
                delta = encode_tree(base, cast["bfloat16"], base_version=version - gap)
                ratio = delta.nbytes / out["bfloat16"]["full_bytes"]
                out["bfloat16_gaps"][str(gap)].append({"version": version, "ratio": ratio})
        older[version] = cast["bfloat16"]
        older.pop(version - max(GAPS), None)
        prev_version, prev = version, cast
        print(f"  version {version} read", flush=True)
    if prev_version is None or not out["float32"]["versions"]:
        raise SystemExit(f"{run_dir}: fewer than two checkpoints")
    return out


GAPS = (2, 4, 8, 16)


def print_deltas(d: dict) -> None:
    for gap, rows in d.get("bfloat16_gaps", {}).items():
        if rows:
            ratios = [x["ratio"] for x in rows]
            print(
                f"(c) bfloat16 against a base {gap} versions older: {len(ratios)} versions, "
                f"delta/full median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, "
                f"max {max(ratios):.4f})"
            )
    for name, r in d.items():
        if name == "bfloat16_gaps":
            continue
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


def _raw_server(total: int, chunk: int):
    """Opaque bytes streamed down over loopback gRPC: the transfer's physical limit here."""
    import grpc

    from rlax_tpu.rpc.transport import make_server

    payload = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)

    def down(request, context):  # noqa: ANN001, ANN202
        for i in range(0, total, chunk):
            yield payload[i : i + chunk].tobytes()

    def add(server) -> None:  # noqa: ANN001
        handlers = {"Down": grpc.unary_stream_rpc_method_handler(down)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Raw", handlers),)
        )

    return make_server("127.0.0.1:0", add)


def worker_role() -> None:
    """A worker process: serves its relay, then on each stdin line (JSON {version, sources} or
    {raw}) receives and reports the wall time it finished."""
    from rlax_tpu.param_server.relay import RelayServer, fetch_to_device
    from rlax_tpu.rpc.transport import make_channel

    rate = float(sys.argv[3])
    server = RelayServer(egress_bytes_per_s=rate, keep=1)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    state: dict = {}
    for line in sys.stdin:
        job = json.loads(line)
        if "jax_pull" in job:  # jax.experimental.transfer from the publisher's server
            from jax.experimental import transfer

            specs = [
                jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=device)
                for shape, dtype in job["specs"]
            ]
            if "conn" not in state:
                ts = transfer.start_transfer_server(
                    jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
                )
                state["conn"] = (ts, ts.connect(job["jax_pull"]))
            arrays = state["conn"][1].pull(job["uuid"], specs)
            jax.block_until_ready(arrays)
            del arrays
            print(json.dumps({"done": time.time()}), flush=True)
            continue
        if "raw" in job:
            channel = make_channel(job["raw"])
            n = sum(len(m) for m in channel.unary_stream("/bench.Raw/Down")(b""))
            channel.close()
            print(json.dumps({"done": time.time(), "bytes": n}), flush=True)
            continue
        count = job["arrays"]
        arrays = fetch_to_device(job["version"], job["sources"], server, [device] * count)
        jax.block_until_ready(arrays)
        del arrays
        print(json.dumps({"done": time.time(), "sent": server.bytes_sent}), flush=True)


def fanout(total_bytes: int, rate: float, counts: tuple[int, ...]) -> dict:
    import subprocess

    from rlax_tpu.param_server.relay import Publisher, RelayServer

    n_arrays = 16
    per = total_bytes // n_arrays // 2
    rng = np.random.default_rng(0)
    arrays = [
        (f"w{i}", rng.integers(0, 2**16, per, dtype=np.uint16).view(ml_dtypes.bfloat16))
        for i in range(n_arrays)
    ]
    nbytes = sum(a.nbytes for _, a in arrays)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", "-", str(rate)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"XLA_FLAGS": ""},
        )
        for _ in range(max(counts))
    ]
    endpoints = [json.loads(p.stdout.readline())["endpoint"] for p in procs]
    root = RelayServer(egress_bytes_per_s=rate, keep=1)
    publisher = Publisher(root)
    raw, raw_port = _raw_server(nbytes, 4 * 2**20)
    version = 0
    results: dict = {"bytes": nbytes, "rate": rate, "runs": []}
    try:
        # Warm-up, not timed: each worker's first upload starts its JAX runtime.
        small = [(p, a[:1024]) for p, a in arrays]
        publisher.publish(version, small)
        for k in range(len(procs)):
            job = {"version": version, "sources": [root.endpoint], "arrays": n_arrays}
            procs[k].stdin.write(json.dumps(job) + "\n")
            procs[k].stdin.flush()
        for k in range(len(procs)):
            procs[k].stdout.readline()
        for shape in ("star", "chain"):
            for n in counts:
                version += 1
                sent0 = root.bytes_sent
                start = time.time()
                publisher.publish(version, arrays)
                for k in range(n):
                    chain = [*reversed(endpoints[:k]), root.endpoint]
                    sources = chain if shape == "chain" else [root.endpoint]
                    job = {"version": version, "sources": sources, "arrays": n_arrays}
                    procs[k].stdin.write(json.dumps(job) + "\n")
                    procs[k].stdin.flush()
                done = [json.loads(procs[k].stdout.readline())["done"] for k in range(n)]
                seconds = max(done) - start
                results["runs"].append(
                    {
                        "shape": shape,
                        "workers": n,
                        "seconds": seconds,
                        "root_bytes": root.bytes_sent - sent0,
                        "per_worker_bytes_per_s": nbytes / seconds,
                    }
                )
                print(
                    f"  {shape} x{n}: {seconds:.2f} s, publisher sent "
                    f"{(root.bytes_sent - sent0) / nbytes:.2f} versions",
                    flush=True,
                )
        if not rate:
            # One worker, version after version, each beside a raw stream of the same bytes: the
            # ratio in steady state (a run publishes many versions; the first ones also pay
            # this process's and the worker's first touches of their buffers' memory).
            results["steady"] = []
            for _ in range(STEADY_VERSIONS):
                raw_s = _raw_stream(procs[0], raw_port)
                version += 1
                start = time.time()
                publisher.publish(version, arrays)
                job = {"version": version, "sources": [root.endpoint], "arrays": n_arrays}
                procs[0].stdin.write(json.dumps(job) + "\n")
                procs[0].stdin.flush()
                relay_s = json.loads(procs[0].stdout.readline())["done"] - start
                results["steady"].append({"raw_s": raw_s, "relay_s": relay_s})
                print(f"  raw {raw_s:.2f} s, relayed {relay_s:.2f} s", flush=True)
            results["raw_loopback_s"] = _raw_stream(procs[0], raw_port)
            results["jax_transfer_s"] = _jax_transfer(arrays, procs[0])
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        root.stop()
        raw.stop(None)
    return results


def _raw_stream(proc, port: int) -> float:  # noqa: ANN001
    """Seconds for the worker process to receive the raw bytes over loopback gRPC."""
    start = time.time()
    proc.stdin.write(json.dumps({"raw": f"127.0.0.1:{port}"}) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["done"] - start


def steady_ratio(r: dict) -> tuple[float, list[float]]:
    """(median of raw / relayed from the third version on, every version's ratio)."""
    ratios = [x["raw_s"] / x["relay_s"] for x in r["steady"]]
    return statistics.median(ratios[2:]), ratios


def _jax_transfer(arrays: list, proc) -> list[float]:  # noqa: ANN001
    """Seconds for a worker process to pull ``arrays`` from this process's devices with
    ``jax.experimental.transfer`` (three rounds; the first opens the connection)."""
    from jax.experimental import transfer

    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    on_device = [jax.device_put(a) for _, a in arrays]
    specs = [(list(a.shape), a.dtype.name) for a in on_device]
    times = []
    for uuid in (1, 2, 3):
        server.await_pull(uuid, on_device)
        start = time.time()
        job = {"jax_pull": server.address(), "uuid": uuid, "specs": specs}
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        times.append(json.loads(proc.stdout.readline())["done"] - start)
    return times


def print_fanout(r: dict) -> None:
    limit = f"egress {r['rate'] / 2**20:.0f} MiB/s a process" if r["rate"] else "no egress limit"
    print(f"(b) {r['bytes'] / 2**30:.2f} GiB to 1, 2, 4 worker processes, {limit}")
    print(
        "| shape | workers | seconds | vs one worker | publisher sent (versions) | GiB/s a worker |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for x in r["runs"]:
        one = next(y for y in r["runs"] if y["shape"] == x["shape"] and y["workers"] == 1)
        print(
            f"| {x['shape']} | {x['workers']} | {x['seconds']:.2f} | "
            f"{x['seconds'] / one['seconds']:.2f} | {x['root_bytes'] / r['bytes']:.2f} | "
            f"{r['bytes'] / x['seconds'] / 2**30:.2f} |"
        )
    one = next(y for y in r["runs"] if y["shape"] == "chain" and y["workers"] == 1)
    if r["rate"]:
        print(f"one worker at {r['bytes'] / one['seconds'] / r['rate']:.2f} of the egress rate")
    else:
        print(
            f"raw loopback gRPC: {r['raw_loopback_s']:.2f} s; one worker at "
            f"{r['raw_loopback_s'] / one['seconds']:.2f} of it; jax.experimental.transfer "
            f"pull into a worker process: {', '.join(f'{t:.2f}' for t in r['jax_transfer_s'])} s"
        )
        median, ratios = steady_ratio(r)
        print(
            f"one worker, {len(ratios)} versions in a row, raw / relayed each beside its own raw "
            f"stream: {', '.join(f'{x:.2f}' for x in ratios)}; median from the third: {median:.2f}"
        )


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        worker_role()
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "fanout":
        total = int(float(sys.argv[2]) * 2**30) if len(sys.argv) > 2 else 2**30
        rate = float(sys.argv[3]) * 2**20 if len(sys.argv) > 3 else 100 * 2**20
        out = {}
        for name, r in (("limited", rate), ("unlimited", 0.0)):
            out[name] = fanout(total, r, (1, 2, 4))
            print_fanout(out[name])
        (HERE / "weight_sync_fanout.json").write_text(json.dumps(out, indent=2))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "deltas":
        d = deltas(Path(sys.argv[2]))
        print_deltas(d)
        (HERE / "weight_sync_deltas.json").write_text(json.dumps(d, indent=2))
        return
    if len(sys.argv) != 1:
        raise SystemExit(
            "usage: weight_sync.py                      (a: one host)\n"
            "       weight_sync.py fanout [GIB [MIB_S]] (b: processes; 1 GiB, 100 MiB/s)\n"
            "       weight_sync.py deltas RUN           (c: a run's checkpoints)"
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
