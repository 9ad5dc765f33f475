"""Inference worker service: paged-attention engine with continuous batching, served over gRPC.

Serves generate (streaming), load_weights(version), status and shutdown on inference.address
(127.0.0.1 unless credentials are configured), and prints the bound address. The model comes
from the run config's model section (served as version 0). With
``controller.param_server_endpoints`` set, load_weights(v) pulls version v from replica
``inference.param_server_replica`` of that parameter server (with the credentials of the
``param_server`` section), only the slices of the worker's own devices, straight into the
engine's shardings; without endpoints, load_weights of any other version answers NOT_FOUND.
Stops on SIGTERM, SIGINT or a Shutdown call.

A worker over several hosts (``inference.distributed``: one process per host, e.g.
``coordinator_address=auto`` on a TPU VM slice) joins the jax.distributed job first; process 0
serves, the others follow its engine steps and pull their own slices of each version, and all
exit when process 0 shuts down; an error or the death of any process ends them all, non-zero,
naming it (``rlax_tpu/multihost.py``).
"""

from __future__ import annotations

from typing import Any

from rlax_tpu import cli, multihost
from rlax_tpu.config import RunConfig
from rlax_tpu.rpc.transport import Credentials


def _replica(config: RunConfig) -> int:
    replica = config.inference.param_server_replica
    if replica >= 0:
        return replica
    replicas = len(config.controller.param_server_endpoints)
    if config.inference.worker_index >= 0:
        return config.inference.worker_index % max(replicas, 1)
    if replicas > 1:
        raise cli.UsageError(
            f"{replicas} parameter-server replicas: set inference.worker_index (this worker "
            "reads replica worker_index mod replicas) or inference.param_server_replica"
        )
    return 0


def _weight_source(config: RunConfig, engine: Any) -> tuple[Any, Any]:
    """(weight source, client to close), both None without parameter-server endpoints."""
    if not config.controller.param_server_endpoints:
        return None, None
    # The composition root may use another component's published client (allowed by name
    # in pyproject's import-linter contracts, like the trainer's sink).
    from rlax_tpu.param_server import client as ps_client

    client = ps_client.ParamServerClient.from_config(
        config.param_server, config.controller.param_server_endpoints, replica=_replica(config)
    )
    return ps_client.PulledWeights(client, engine.weight_shardings()), client


def _relay(config: RunConfig, pulled: Any) -> tuple[Any, list[Any]]:
    """With ``param_server.fanout`` "relay" on a worker of one process: (its weight source,
    receiving versions from the sources each load names and serving them on, and the relay's
    handlers for the worker's server); else (``pulled``, [])."""
    ps = config.param_server
    if ps.fanout != "relay" or pulled is None or config.inference.distributed.num_processes > 1:
        return pulled, []
    from rlax_tpu.param_server import relay

    cfg = config.inference
    own = Credentials(auth_token_file=cfg.auth_token_file, tls_cert_file=cfg.tls_cert_file)
    servers = Credentials(auth_token_file=ps.auth_token_file, tls_cert_file=ps.tls_cert_file)
    endpoints = set(config.controller.param_server_endpoints)
    service = relay.RelayService(keep=1, appear_s=ps.relay_appear_s)
    source = relay.RelayedWeights(
        service,
        pulled.shardings,
        pulled,
        # Other workers with this worker's credentials, the parameter server with its own.
        credentials=lambda endpoint: servers if endpoint in endpoints else own,
        deltas=ps.relay_deltas,
    )
    return source, [service.handlers()]


def run(config: RunConfig, args: list[str]) -> int:
    del args
    _replica(config)  # a usage error before anything starts
    lead = multihost.initialize(config.inference.distributed)
    from rlax_tpu.inference.service import serve
    from rlax_tpu.inference.worker import Follower, InferenceWorker

    if not lead:
        follower = Follower.from_config(config)
        follower.weight_source, client = _weight_source(config, follower.engine)
        steps = follower.run()
        print(f"rlax_tpu.inference: follower stopped after {steps} engine steps", flush=True)
        if client is not None:
            client.close()
        multihost.shutdown(config.inference.distributed)
        return cli.EXIT_STOPPED  # the lead stopped: so does this host's share of the job
    cfg = config.inference
    worker = InferenceWorker.from_config(config)
    pulled, client = _weight_source(config, worker.engine)
    worker.weight_source, handlers = _relay(config, pulled)
    stop = cli.stop_event()
    server, port = serve(
        worker,
        cfg.address,
        credentials=Credentials(
            auth_token_file=cfg.auth_token_file, tls_cert_file=cfg.tls_cert_file
        ),
        on_shutdown=stop.set,
        handlers=handlers,
    )
    host = cfg.address.rsplit(":", 1)[0]
    status = worker.status()
    source = ""
    if client is not None:
        source = f", weights from {client.endpoints[client.replica]}"
        if handlers:
            source += " or the worker before this one (a relay chain)"
    print(
        f"rlax_tpu.inference: serving on {host}:{port} (backend {status.backend}, "
        f"version {status.version}, {status.pages_total} KV pages{source})",
        flush=True,
    )
    cli.wait_for(stop)
    worker.shutdown()
    server.stop(grace=2.0).wait()
    if handlers:
        counts, sent = worker.weight_source.counts, worker.weight_source.service.bytes_sent
        print(
            f"rlax_tpu.inference: versions received over the relay {counts['relayed']} "
            f"({counts['as_deltas']} as deltas, {counts['bytes_received']} bytes), pulled "
            f"{counts['pulled']}; {sent} bytes passed on to the next worker",
            flush=True,
        )
    if client is not None:
        client.close()
    multihost.shutdown(config.inference.distributed)
    return cli.EXIT_STOPPED


if __name__ == "__main__":
    cli.main("inference", run)
