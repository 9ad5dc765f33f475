"""Four jax.distributed processes (gloo over 127.0.0.1, 2 CPU devices each, two slices) take the
same step as one process with 8 devices, and publish the new version to a parameter server in
parts, no process sending (or holding) the whole model; a process whose push fails fails every
process's publish.

Tolerance: the cross-process reductions run through gloo instead of XLA's in-process
all-reduce, so the order of f32 sums may differ: loss 1e-6 absolute, gradient norm 1e-5
relative, params 1e-6 absolute (0.1% of the update; adam_eps = 1e-5 as in test_sharded_step).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from rlax_tpu.trainer import Trainer
from tests.child_env import child_env
from tests.conftest import free_port

from .helpers import host, random_batch, run_config

WORKER = Path(__file__).with_name("distributed_worker.py")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process's step on its 8 devices, (1, 8, 1)."""
    trainer = Trainer(
        run_config((1, 8, 1), adam_eps=1e-5), checkpoint_dir=tmp_path_factory.mktemp("one")
    )
    metrics = trainer.train_step(random_batch(0))
    expected = jax.tree.leaves(host(trainer.params()))
    trainer.close()
    return metrics, expected


def run_processes(
    tmp_path: Path, processes: int, mesh: str, **env: str
) -> tuple[Any, list, list[int]]:
    """``processes`` workers (8 devices between them) on MESH "data,fsdp,tensor,slices",
    publishing to a parameter server: (process 0's npz, the published leaves, bytes each
    process pushed)."""
    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.param_server.client import ParamServerClient
    from rlax_tpu.param_server.service import serve

    server, port, store = serve(ParamServerConfig(persist_every=0))
    coordinator = f"127.0.0.1:{free_port()}"
    env = child_env() | env
    args = [coordinator, "PID", str(tmp_path), f"127.0.0.1:{port}", str(processes), mesh]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *[str(pid) if a == "PID" else a for a in args]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(processes)
    ]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out[-3000:]
        client = ParamServerClient(f"127.0.0.1:{port}")
        versions = [v.version for v in client.list_versions()[0]]
        published = jax.tree.leaves(client.pull(1)) if 1 in versions else []
        client.close()
    finally:
        for p in procs:
            p.kill()
        server.stop(None)
        store.close()
    if any((tmp_path / f"failed-{pid}").exists() for pid in range(processes)):
        return None, published, []
    pushed = [int((tmp_path / f"pushed-{pid}").read_text()) for pid in range(processes)]
    return np.load(tmp_path / "params.npz"), published, pushed


def assert_same_step(got, published, one_process) -> None:  # noqa: ANN001
    metrics, expected = one_process
    np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], metrics["grad_norm"], rtol=1e-5)
    assert len(expected) == len(got.files) - 2
    for i, leaf in enumerate(expected):
        np.testing.assert_allclose(got[str(i)], leaf, rtol=0, atol=1e-6)
    # Version 1 as the processes published it, each its own part: the same parameters.
    assert len(published) == len(expected)
    for leaf, want in zip(published, expected, strict=True):
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=0, atol=1e-6)


def test_two_slices_of_two_processes_equal_one_process(one_process, tmp_path):
    """Multislice emulated on CPU (mesh.slices = 2): 4 processes of 2 devices, 2 per slice,
    each slice a (1, 2, 2) mesh of its own processes' devices, stacked on data: (2, 2, 2). Same
    tolerance as above (gloo's sums across processes). The processes publish the version in
    parts: together exactly the model's bytes (a replica's copy is sent once), none sends it
    whole."""
    got, published, pushed = run_processes(tmp_path, 4, "1,2,2,2")
    layout = (tmp_path / "mesh-0").read_text()
    assert layout == "{'data': 2, 'fsdp': 2, 'expert': 1, 'tensor': 2} [[0, 1], [2, 3]]", layout
    assert_same_step(got, published, one_process)
    whole = sum(x.nbytes for x in one_process[1])
    assert sum(pushed) == whole and max(pushed) < 0.6 * whole, pushed


def test_a_process_whose_push_fails_fails_every_process_s_publish(tmp_path):
    """Process 1 cannot reach the parameter server: both processes' publish fail, naming it,
    instead of process 0 waiting in a device barrier process 1 never enters; the version was
    not committed (process 0's part alone is not a version)."""
    got, published, _ = run_processes(tmp_path, 2, "1,8,1,1", FAIL_PUSH_ON="1")
    assert got is None and published == []
    assert (tmp_path / "failed-1").read_text() == (
        "ConnectionError: no route to the parameter server"
    )
    assert (tmp_path / "failed-0").read_text() == (
        "PublishError: version 1 was not published: process 1: ConnectionError: no route to "
        "the parameter server"
    )
