"""Two jax.distributed processes (gloo over 127.0.0.1, 4 CPU devices each) take the same step as
one process with 8 devices on the same (1, 8, 1) mesh, and publish the new version to a parameter
server in parts, neither process sending (or holding) the whole model.

Tolerance: the cross-process reductions run through gloo instead of XLA's in-process
all-reduce, so the order of f32 sums may differ: loss 1e-6 absolute, gradient norm 1e-5
relative, params 1e-6 absolute (0.1% of the update; adam_eps = 1e-5 as in test_sharded_step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from rlax_tpu.trainer import Trainer
from tests.conftest import free_port

from .helpers import host, random_batch, run_config

WORKER = Path(__file__).with_name("distributed_worker.py")


def test_two_processes_equal_one(tmp_path):
    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.param_server.client import ParamServerClient
    from rlax_tpu.param_server.service import serve

    server, port, store = serve(ParamServerConfig(persist_every=0))
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                coordinator,
                str(pid),
                str(tmp_path),
                f"127.0.0.1:{port}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    # Meanwhile the one-process reference on this process's 8 devices.
    trainer = Trainer(run_config((1, 8, 1), adam_eps=1e-5), checkpoint_dir=tmp_path / "one")
    metrics = trainer.train_step(random_batch(0))
    expected = jax.tree.leaves(host(trainer.params()))
    trainer.close()
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    got = np.load(tmp_path / "params.npz")
    np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], metrics["grad_norm"], rtol=1e-5)
    assert len(expected) == len(got.files) - 2
    for i, leaf in enumerate(expected):
        np.testing.assert_allclose(got[str(i)], leaf, rtol=0, atol=1e-6)
    # Version 1 as the two processes published it, each its own half: the same parameters.
    client = ParamServerClient(f"127.0.0.1:{port}")
    published = jax.tree.leaves(client.pull(1))
    client.close()
    server.stop(None)
    store.close()
    assert len(published) == len(expected)
    for leaf, want in zip(published, expected, strict=True):
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=0, atol=1e-6)
    whole = sum(x.nbytes for x in expected)
    pushed = [int((tmp_path / f"pushed-{pid}").read_text()) for pid in (0, 1)]
    assert sum(pushed) == whole and max(pushed) < 0.6 * whole, pushed
