"""Two jax.distributed processes (gloo over 127.0.0.1, 4 CPU devices each) take the same step as
one process with 8 devices on the same (2, 4, 1) mesh.

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
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(pid), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for pid in (0, 1)
    ]
    # Meanwhile the one-process reference on this process's 8 devices.
    trainer = Trainer(run_config((2, 4, 1), adam_eps=1e-5), checkpoint_dir=tmp_path / "one")
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
