"""Trainer service: sharded JAX train steps, aligned log-prob recompute, Orbax checkpoints.

Serves train_step(batch), publish, save, restore and status over gRPC on trainer.address and
prints the bound address; stops cleanly on SIGTERM / SIGINT. Weights are published to the
parameter server only when a sink is wired in-process (see rlax_tpu.trainer.Trainer); this
entry point runs without one, and Publish answers FAILED_PRECONDITION.
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
    trainer = Trainer(config)
    server, port = serve(trainer, config.trainer)
    host = config.trainer.address.rsplit(":", 1)[0]
    print(f"rlax_tpu.trainer: serving on {host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()
    trainer.close()
    print("rlax_tpu.trainer: stopped", flush=True)
    return 0


if __name__ == "__main__":
    cli.main("trainer", run)
