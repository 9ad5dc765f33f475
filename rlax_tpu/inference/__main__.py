"""Inference worker service: paged-attention engine with continuous batching, served over gRPC.

Serves generate (streaming), load_weights(version), status and shutdown on inference.address
(127.0.0.1 unless credentials are configured), and prints the bound address. The model comes
from the run config's model section (served as version 0). With
``controller.param_server_endpoint`` set, load_weights(v) pulls version v from that parameter
server (with the credentials of the ``param_server`` section), shaped like the model's own
parameters; without one, load_weights of any other version answers NOT_FOUND. Stops on SIGTERM,
SIGINT or a Shutdown call.
"""

from __future__ import annotations

import signal
import threading

from rlax_tpu import cli
from rlax_tpu.config import RunConfig
from rlax_tpu.inference.service import serve
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.rpc.transport import Credentials


def run(config: RunConfig, args: list[str]) -> int:
    del args
    cfg = config.inference
    worker = InferenceWorker.from_config(config)
    client = None
    if config.controller.param_server_endpoint:
        # The composition root may use another component's published client (allowed by name
        # in pyproject's import-linter contracts, like the trainer's sink).
        from flax import nnx

        from rlax_tpu.param_server import client as ps_client

        client = ps_client.ParamServerClient.from_config(
            config.param_server, config.controller.param_server_endpoint
        )
        like = nnx.to_pure_dict(worker.engine.state)  # version 0's tree, before serving
        worker.weight_source = ps_client.PulledWeights(client, like)
    stop = threading.Event()
    server, port = serve(
        worker, cfg.address,
        credentials=Credentials(auth_token_file=cfg.auth_token_file,
                                tls_cert_file=cfg.tls_cert_file),
        on_shutdown=stop.set,
    )  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    host = cfg.address.rsplit(":", 1)[0]
    status = worker.status()
    source = f", weights from {config.controller.param_server_endpoint}" if client else ""
    print(f"rlax_tpu.inference: serving on {host}:{port} (backend {status.backend}, "
          f"version {status.version}, {status.pages_total} KV pages{source})", flush=True)  # fmt: skip
    stop.wait()
    worker.shutdown()
    server.stop(grace=2.0).wait()
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    cli.main("inference", run)
