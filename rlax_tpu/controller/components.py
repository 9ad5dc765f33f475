"""The two transports: the same set of components, in this process or behind gRPC endpoints.

``local``: a parameter server (a real gRPC server on 127.0.0.1; in memory only, the trainer's
checkpoints being the persistent copy; one per ``param_server.replicas``, worker i reading replica
i mod replicas), the trainer, the inference workers and the verifier service, all in this process.
With the trainer in this process (and ``param_server.device_versions``), versions go from the
trainer to the workers device to device (controller/handoff.py) and reach the parameter server
from a background copy; with the trainer in a child process they travel through it.
``distributed``: gRPC clients to the endpoints of ``controller.*_endpoint(s)``; a component that does
not answer raises ``ComponentUnreachable`` naming it and its endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any

import jax

from rlax_tpu import models, storage
from rlax_tpu.config import RunConfig
from rlax_tpu.config.run import handoff_versions
from rlax_tpu.controller.ports import InferencePort, ParamServerPort, TrainerPort, VerifierPort
from rlax_tpu.param_server.client import ParamServerClient, PulledWeights
from rlax_tpu.rpc.transport import Credentials, Named

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Components:
    workers: list[InferencePort]
    verifier: VerifierPort
    trainer: TrainerPort
    param_server: ParamServerPort
    endpoints: dict[str, str]  # component name -> where it runs ("in-process" or host:port)
    # versions handed device to device (local transport, trainer in process); None: pulled
    handoff: Any = None
    # SHA-256 of the trainer's current parameters (local transport; None where they are remote)
    params_digest: Callable[[], str] | None = None
    _closers: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        _close_all(self._closers)


def _close_all(closers: list[Callable[[], None]]) -> None:
    """Calls every closer, newest first; a failure is logged, never raised (closing must not
    hide the run's own error), and the list is emptied."""
    for close in reversed(closers):
        try:
            close()
        except Exception as e:
            log.warning("closing a component failed: %s", e)
    closers.clear()


@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    """One process's devices shared out (topology.trainer_devices): the trainer's first, then
    each inference worker's group of inference.mesh's size."""

    trainer: list[jax.Device]
    workers: list[list[jax.Device]]

    @classmethod
    def of(cls, config: RunConfig) -> DeviceSplit:
        devices = jax.devices()
        k = config.topology.trainer_devices
        m = config.inference.mesh
        per_worker = math.prod(m.sizes)
        need = k + per_worker * config.inference.num_workers
        if need > len(devices):
            raise ValueError(
                f"topology.trainer_devices ({k}) + inference.num_workers "
                f"({config.inference.num_workers}) x inference.mesh ({per_worker} devices) = "
                f"{need} devices; this host has {len(devices)}"
            )
        workers = [
            devices[k + i * per_worker : k + (i + 1) * per_worker]
            for i in range(config.inference.num_workers)
        ]
        return cls(trainer=devices[:k], workers=workers)


def build_local(
    config: RunConfig,
    *,
    model: models.Transformer,
    eos_ids: Collection[int],
    run_dir: storage.epath.Path,
    trainer_devices: list[jax.Device] | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
) -> Components:
    """Every component in this process (the trainer in a child process with
    ``controller.trainer_process``); the parameter server on a loopback port. The trainer's mesh
    spans ``trainer_devices`` (default: every device; the child's own with trainer_process).
    ``detokenize``: the workers' for stop strings (the tokenizer's ``text_of``)."""
    from rlax_tpu.inference.worker import InferenceWorker
    from rlax_tpu.param_server.service import serve
    from rlax_tpu.trainer.trainer import Trainer
    from rlax_tpu.verifiers.service import VerifierService

    closers: list[Callable[[], None]] = []
    split = DeviceSplit.of(config) if config.topology.trainer_devices else None
    if split is not None:
        trainer_devices = split.trainer
    try:
        ps_config = dataclasses.replace(config.param_server, address="127.0.0.1:0")
        replicas = []
        for r in range(ps_config.replicas):
            # No write-through here: in one process the trainer's checkpoints are the persistent
            # copy, and a resumed run republishes the versions it needs from them.
            server, port, store = serve(dataclasses.replace(ps_config, replica_index=r))
            closers += [store.close, partial(_stop, server)]
            replicas.append(f"127.0.0.1:{port}")
        endpoint = ", ".join(replicas)
        ps_client = ParamServerClient.from_config(ps_config, replicas)
        closers.append(ps_client.close)
        scratch = tempfile.TemporaryDirectory(prefix="rlax-verifier-")
        closers.append(scratch.cleanup)
        verifier = VerifierService(config.verifiers, scratch_dir=Path(scratch.name))
        closers.append(verifier.close)
        trainer_where = "in-process"
        handoff = None
        if config.controller.trainer_process:
            from rlax_tpu.controller.trainer_process import TrainerProcess

            child = TrainerProcess(
                config,
                model=model,
                checkpoint_dir=run_dir / "trainer",
                param_server_endpoints=replicas,
            )
            closers.append(child.close)
            trainer: TrainerPort = Named(child.client, "trainer", child.endpoint)
            digest = child.params_sha256
            trainer_where = f"{child.endpoint} (child process {child.process.pid})"
        else:
            sink: Any = ps_client
            keep = handoff_versions(config)
            if keep and jax.process_count() == 1:
                from rlax_tpu.controller.handoff import DeviceHandoff

                handoff = sink = DeviceHandoff(ps_client, keep=keep)
                closers.append(handoff.close)
            trainer = Trainer(
                config,
                sink=sink,
                model=model,
                devices=trainer_devices,
                checkpoint_dir=run_dir / "trainer",
            )
            closers.append(trainer.close)
            digest = partial(_trainer_digest, trainer)
        workers = []
        for i in range(config.inference.num_workers):
            worker = InferenceWorker(
                model,
                config.inference,
                eos_ids=eos_ids,
                devices=split.workers[i] if split else None,
                run_dir=config.controller.run_dir,
                detokenize=detokenize,
            )
            closers.append(worker.shutdown)
            workers.append(worker)
            replica = config.inference.param_server_replica
            reader = ParamServerClient.from_config(
                ps_config, replicas, replica=replica if replica >= 0 else i % len(replicas)
            )
            closers.append(reader.close)
            pulled = PulledWeights(reader, worker.engine.weight_shardings())
            worker.weight_source = (
                pulled
                if handoff is None
                else handoff.source(worker.engine.weight_shardings(), pulled)
            )
    except BaseException:
        _close_all(closers)
        raise
    return Components(
        workers=workers,
        verifier=verifier,
        trainer=trainer,
        param_server=ps_client if handoff is None else handoff.port(ps_client),
        params_digest=digest,
        handoff=handoff,
        endpoints={
            "param_server": endpoint
            + ("" if handoff is None else " (versions reach the workers device to device)"),
            "trainer": trainer_where + (placed(trainer) if split else ""),
            "verifiers": "in-process",
            "inference": f"in-process x{len(workers)}"
            + (",".join(placed(w.engine) for w in workers) if split else ""),
        },
        _closers=closers,
    )


def _stop(server: Any) -> None:
    server.stop(grace=1).wait()


def placed(component: Any) -> str:
    """ " on devices [...]" of a component's mesh ("" without one)."""
    mesh = getattr(component, "mesh", None)
    if mesh is None or not isinstance(mesh, jax.sharding.Mesh):
        return ""
    return f" on devices {sorted(d.id for d in mesh.devices.flat)}"


def _trainer_digest(trainer: Any) -> str:
    from rlax_tpu.trainer.checkpoint import tree_sha256

    return tree_sha256(trainer.params())


def build_distributed(config: RunConfig) -> Components:
    """gRPC clients to the configured endpoints, each checked within controller.rpc_timeout_s."""
    from rlax_tpu.inference.service import InferenceClient
    from rlax_tpu.trainer.client import TrainerClient
    from rlax_tpu.verifiers.client import VerifierClient

    c = config.controller
    creds = Credentials(auth_token_file=c.auth_token_file, tls_cert_file=c.tls_cert_file)
    timeout = c.rpc_timeout_s
    closers: list[Callable[[], None]] = []
    try:
        ps = ParamServerClient(
            c.param_server_endpoints,
            credentials=creds,
            chunk_bytes=config.param_server.chunk_bytes,
            max_message_bytes=config.param_server.max_message_bytes,
        )
        closers.append(ps.close)
        ps.wait_ready(timeout)
        trainer = TrainerClient(c.trainer_endpoint, credentials=creds)
        closers.append(trainer.close)
        trainer.wait_ready(timeout)
        verifier = VerifierClient(c.verifier_endpoint, credentials=creds, connect_timeout_s=timeout)
        closers.append(verifier.close)
        workers = []
        for k, endpoint in enumerate(c.inference_endpoints):
            worker = InferenceClient(
                endpoint, credentials=creds, relay_sources=relay_sources(config, k)
            )
            closers.append(worker.close)
            worker.wait_ready(timeout)
            workers.append(worker)
    except BaseException:
        _close_all(closers)
        raise
    return Components(
        workers=workers,
        verifier=Named(verifier, "verifiers", c.verifier_endpoint),
        trainer=Named(trainer, "trainer", c.trainer_endpoint),
        param_server=Named(ps, "param_server", ", ".join(c.param_server_endpoints)),
        endpoints={
            "param_server": ", ".join(c.param_server_endpoints),
            "trainer": c.trainer_endpoint,
            "verifiers": c.verifier_endpoint,
            "inference": ", ".join(c.inference_endpoints),
        },
        _closers=closers,
    )


def relay_sources(config: RunConfig, k: int) -> tuple[str, ...]:
    """Where worker k receives versions from with ``param_server.fanout`` "relay": the worker
    before it, then the parameter-server replicas (its own first); () otherwise. One upstream
    worker, not more: a relay that is not receiving the version makes its reader wait
    ``relay_appear_s`` before the next source, and the parameter server always has it."""
    c = config.controller
    if config.param_server.fanout != "relay":
        return ()
    replicas = list(c.param_server_endpoints)
    r = k % max(1, len(replicas))
    upstream = [c.inference_endpoints[k - 1]] if k > 0 else []
    return (*upstream, *replicas[r:], *replicas[:r])


def wait_until_serving(config: RunConfig, timeout_s: float) -> None:
    """Blocks until the trainer, every parameter-server replica, the verifier service and at least
    one inference worker (the pool waits for the others itself) answer their Health RPC as
    serving; retries with backoff (0.25 s, doubling to 1 s: a probe is cheap, and every second
    a restarted component sits unnoticed is a second of the run lost). Raises ComponentUnreachable naming the
    first component still silent after ``timeout_s``."""
    from rlax_tpu.rpc.probe import probe
    from rlax_tpu.rpc.transport import ComponentUnreachable

    c = config.controller
    creds = Credentials(auth_token_file=c.auth_token_file, tls_cert_file=c.tls_cert_file)
    required = [
        ("ParamServer", f"param_server replica {r}", e)
        for r, e in enumerate(c.param_server_endpoints)
    ]
    required += [
        ("Trainer", "trainer", c.trainer_endpoint),
        ("Verifier", "verifiers", c.verifier_endpoint),
    ]
    workers = [
        ("Inference", f"inference worker {i}", e) for i, e in enumerate(c.inference_endpoints)
    ]
    deadline = time.monotonic() + timeout_s
    delay = 0.25

    def serving(target: tuple[str, str, str]) -> bool:
        left = deadline - time.monotonic()
        try:
            return probe(target[0], target[2], creds, timeout_s=min(5.0, max(0.2, left))).serving
        except Exception:  # gRPC errors, and a refused connection
            return False

    while True:
        required = [t for t in required if not serving(t)]
        if not required and any(serving(w) for w in workers):
            return
        if time.monotonic() >= deadline:
            _, name, endpoint = (required or workers)[0]
            raise ComponentUnreachable(name, endpoint, timeout_s)
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(2 * delay, 1.0)
