"""Trainer service: sharded JAX train steps, aligned log-prob recompute, Orbax checkpoints.

Serves train_step(batch), publish, save, restore and status over gRPC on trainer.address and
prints the bound address; stops cleanly on SIGTERM / SIGINT. Each update publishes version
v+1 to every parameter-server replica of ``controller.param_server_endpoints`` (with the
credentials of the ``param_server`` section); without endpoints nothing is published and Publish answers
FAILED_PRECONDITION.
"""

from __future__ import annotations

import signal
import sys
import threading

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    from rlax_tpu.trainer.service import serve
    from rlax_tpu.trainer.trainer import Trainer

    if args:
        print(f"rlax_tpu.trainer: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    sink = None
    if config.controller.param_server_endpoints:
        # The composition root may use another component's published client (the only such
        # import, allowed by name in pyproject's import-linter contracts).
        from rlax_tpu.param_server.client import ParamServerClient

        sink = ParamServerClient.from_config(
            config.param_server, config.controller.param_server_endpoints
        )
    trainer = Trainer(config, sink=sink)
    server, port = serve(trainer, config.trainer)
    host = config.trainer.address.rsplit(":", 1)[0]
    print(f"rlax_tpu.trainer: serving on {host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()
    trainer.close()
    if sink is not None:
        sink.close()
    print("rlax_tpu.trainer: stopped", flush=True)
    return 0


if __name__ == "__main__":
    cli.main("trainer", run)
