"""The local transport's trainer in a child process (``controller.trainer_process = True``).

In one interpreter the trainer shares the GIL and XLA's host threads with the inference engine,
the verifier's driver threads and the controller; its aligned log-prob replay dispatches one small
jitted call per token, so overlapped generation and training slow each other down. A spawned
child (a fresh interpreter with its own XLA client, the same environment) runs the Trainer behind
its gRPC service on 127.0.0.1, and the controller drives it through ``TrainerClient``, as the
distributed transport does. The child starts from the parent's model weights (after the warm-up),
checkpoints to the same directory and publishes to the parent's parameter server.

    proc = TrainerProcess(config, model=model, checkpoint_dir=run_dir / "trainer",
                          param_server_endpoints=["127.0.0.1:PORT"])
    proc.client.train_step(batch)
    proc.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import RunConfig
from rlax_tpu.rpc.transport import Credentials

_STOP, _DIGEST = "stop", "digest"


def pin(cpus: set[int]) -> None:
    """Restricts every thread of this process (and the threads it starts later) to ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just exited
            os.sched_setaffinity(int(tid), cpus)


def _serve(
    config: RunConfig,
    params: dict[str, Any],
    checkpoint_dir: str,
    endpoints: list[str],
    conn: Connection,
) -> None:
    """The child: builds the trainer on ``params``, sends its port, serves until told to stop
    (or until the parent goes away: its end of the pipe closes)."""
    from rlax_tpu.param_server.client import ParamServerClient
    from rlax_tpu.trainer.service import serve
    from rlax_tpu.trainer.trainer import Trainer

    try:
        if config.controller.trainer_cpus:
            pin(set(config.controller.trainer_cpus))
        graphdef, state = nnx.split(models.abstract_model(config.model))
        nnx.replace_by_pure_dict(state, params)  # shapes only until now: nothing to copy
        model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))
        sink = ParamServerClient.from_config(config.param_server, endpoints)
        trainer = Trainer(config, sink=sink, model=model, checkpoint_dir=checkpoint_dir)
        server, port = serve(trainer, dataclasses.replace(config.trainer, address="127.0.0.1:0"))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    from rlax_tpu.trainer.checkpoint import tree_sha256

    conn.send(("port", port))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message != _DIGEST:
            break
        conn.send(tree_sha256(trainer.params()))
    server.stop(grace=5).wait()
    trainer.close()
    sink.close()


class TrainerProcess:
    """A trainer in a spawned child process; ``client`` is a TrainerClient connected to it."""

    def __init__(
        self,
        config: RunConfig,
        *,
        model: models.Transformer,
        checkpoint_dir: str | Path,
        param_server_endpoints: list[str],
        start_timeout_s: float = 300.0,
    ):
        from rlax_tpu.trainer.client import TrainerClient

        params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.split(model)[1]))
        ctx = multiprocessing.get_context("spawn")  # fork would copy this process's XLA threads
        self._conn, child_end = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve,
            name="rlax-trainer",
            daemon=True,
            args=(config, params, str(checkpoint_dir), list(param_server_endpoints), child_end),
        )
        self.process.start()
        child_end.close()
        if not self._conn.poll(start_timeout_s):
            self._kill()
            raise RuntimeError(
                f"trainer child process (pid {self.process.pid}) did not start "
                f"serving within {start_timeout_s:.0f} s"
            )
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.process.join(5)
            kind, value = "error", f"it exited with code {self.process.exitcode}"
        if kind != "port":
            self._kill()
            raise RuntimeError(f"trainer child process failed to start: {value}")
        self.endpoint = f"127.0.0.1:{value}"
        # The child's server demands what trainer.* names (as `python -m rlax_tpu.trainer` does).
        creds = Credentials(
            auth_token_file=config.trainer.auth_token_file,
            tls_cert_file=config.trainer.tls_cert_file,
        )
        self.client = TrainerClient(self.endpoint, credentials=creds)
        self.client.wait_ready(start_timeout_s)

    def params_sha256(self) -> str:
        """``trainer.checkpoint.tree_sha256`` of the child trainer's current parameters."""
        self._conn.send(_DIGEST)
        return self._conn.recv()

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stops the server and the child (killed if it does not exit within ``timeout_s``)."""
        self.client.close()
        with contextlib.suppress(OSError):  # the child is gone already
            self._conn.send(_STOP)
        self.process.join(timeout_s)
        if self.process.is_alive():
            self._kill()
        self._conn.close()
