"""Parameter server: TensorStore-backed, versioned weights served over gRPC.

Serves publish, pull, list_versions, report_progress/lease and health on param_server.address,
persisting every param_server.persist_every-th version to param_server.persist_path (default
<controller.run_dir>/param_server). On start it serves the newest complete persisted version.
Prints "param_server listening on HOST:PORT" once ready; SIGTERM or SIGINT stops it (exit 0).
"""

from __future__ import annotations

from rlax_tpu import cli
from rlax_tpu.config import RunConfig
from rlax_tpu.param_server.service import persist_location, serve


def run(config: RunConfig, args: list[str]) -> int:
    stop = cli.stop_event()
    server, port, store = serve(config.param_server, persist_location=persist_location(config))
    host = config.param_server.address.rpartition(":")[0]
    print(f"param_server listening on {host}:{port}", flush=True)
    cli.wait_for(stop)
    server.stop(grace=5).wait()
    store.flush(timeout_s=60)  # let a write-through in progress finish
    store.close()
    return cli.EXIT_STOPPED


if __name__ == "__main__":
    cli.main("param_server", run)
