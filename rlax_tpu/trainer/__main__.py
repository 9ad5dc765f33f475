"""Trainer service: sharded JAX train steps, aligned log-prob recompute, Orbax checkpoints.

Serves train_step(batch), publish, save, restore and status over gRPC on trainer.address and
prints the bound address; stops cleanly on SIGTERM / SIGINT. Each update publishes version
v+1 to every parameter-server replica of ``controller.param_server_endpoints`` (with the
credentials of the ``param_server`` section); without endpoints nothing is published and Publish answers
FAILED_PRECONDITION.

A trainer over several hosts (``trainer.distributed``: one process per host, e.g.
``coordinator_address=auto`` on a TPU VM slice) joins the jax.distributed job first; process 0
serves, the others make every call it makes (``trainer/lockstep.py``); each process publishes and
checkpoints its own shards. SIGTERM to process 0 stops them all; an error or the death of any
process ends them all, non-zero, naming it (``rlax_tpu/multihost.py``).
"""

from __future__ import annotations

import sys
from typing import Any

from rlax_tpu import cli, multihost
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    if args:
        print(f"rlax_tpu.trainer: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
    lead = multihost.initialize(config.trainer.distributed, slices=config.mesh.slices)
    from rlax_tpu.trainer.lockstep import LeadTrainer, follow
    from rlax_tpu.trainer.service import serve
    from rlax_tpu.trainer.trainer import Trainer

    sink = None
    if config.controller.param_server_endpoints:
        # The composition root may use another component's published client (the only such
        # import, allowed by name in pyproject's import-linter contracts).
        from rlax_tpu.param_server.client import ParamServerClient

        sink = ParamServerClient.from_config(
            config.param_server, config.controller.param_server_endpoints
        )
    trainer = Trainer(config, sink=sink)
    several = config.trainer.distributed.enabled
    print(f"rlax_tpu.trainer: {_layout(trainer.mesh, config)}", flush=True)
    if not lead:
        calls = follow(trainer)
        print(f"rlax_tpu.trainer: follower stopped after {calls} calls{_pushed(sink)}", flush=True)
        _close(trainer, sink, config)
        return cli.EXIT_STOPPED  # the lead stopped: so does this host's share of the job
    served = LeadTrainer(trainer) if several else trainer
    server, port = serve(served, config.trainer)
    host = config.trainer.address.rsplit(":", 1)[0]
    print(f"rlax_tpu.trainer: serving on {host}:{port}", flush=True)
    stop = cli.stop_event()
    cli.wait_for(stop)
    server.stop(grace=5).wait()
    if several:
        served.stop()
    _close(trainer, sink, config)
    print(f"rlax_tpu.trainer: stopped{_pushed(sink)}", flush=True)
    return cli.EXIT_STOPPED


def _layout(mesh: Any, config: RunConfig) -> str:
    """This process's place in the job and the mesh's shape, e.g. "process 3 of 4 (slice 1),
    mesh data 2 x fsdp 2 x expert 1 x tensor 1 over 2 slices"."""
    import jax

    slices = config.mesh.slices
    where = f"process {jax.process_index()} of {jax.process_count()}"
    if slices > 1:
        where += f" (slice {jax.process_index() // (jax.process_count() // slices)})"
    shape = " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items())
    across = f" over {slices} slices" if slices > 1 else ""
    return f"{where}, mesh {shape}{across}"


def _pushed(sink: Any) -> str:
    return f"; published {sink.bytes_pushed} bytes of parameters" if sink is not None else ""


def _close(trainer: Any, sink: Any, config: RunConfig) -> None:
    trainer.close()
    if sink is not None:
        sink.close()
    multihost.shutdown(config.trainer.distributed)


if __name__ == "__main__":
    cli.main("trainer", run)
