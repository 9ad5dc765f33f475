"""One process's devices split between the trainer and the inference workers
(topology.trainer_devices), as on a single TPU VM, driven from the main command: the versions go
from the trainer's devices to the workers' (controller/handoff.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
UID = 1_450_000 + (os.getpid() % 100_000) * 8


def test_the_trainer_and_two_workers_run_on_their_own_devices(tmp_path):
    env = child_env(devices=8)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_tpu.controller",
            "--config=configs/codeforces.py:local",
            f"--config.controller.run_dir={tmp_path / 'run'}",
            "--config.controller.num_steps=3",
            "--config.controller.prompts_per_step=2",
            "--config.algorithm.group_size=2",
            "--config.trainer.micro_batch_size=4",
            "--config.model.num_layers=1",
            "--config.inference.max_new_tokens=16",
            "--config.inference.max_concurrent_seqs=8",
            "--config.data.eval_problems=4",
            "--config.data.eval_samples=2",
            "--config.controller.warmup_steps=0",
            f"--config.verifiers.sandbox_uid={UID}",
            "--config.topology.trainer_devices=4",
            "--config.inference.num_workers=2",
            "--config.inference.mesh.tensor=2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run finished: 3 updates" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("components:"))
    assert "trainer in-process on devices [0, 1, 2, 3]" in line, line
    assert "on devices [4, 5], on devices [6, 7]" in line, line
    # Every version the workers load comes from the trainer's devices, none through the server;
    # version 1 reaches both workers, which the summary times.
    loads = next(x for x in done.stdout.splitlines() if x.startswith("weight loads:"))
    device, server = (int(w) for w in loads.split() if w.isdigit())
    assert device >= 2 and server == 0, loads
    assert "publish to serve (trainer's publish -> every worker serving the version)" in done.stdout
    assert "weights over the network: 0.0 MiB in " in done.stdout  # none: device to device


def test_a_split_that_does_not_fit_is_refused(tmp_path):
    env = child_env(devices=4)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_tpu.controller",
            "--config=configs/codeforces.py:local",
            f"--config.controller.run_dir={tmp_path / 'run'}",
            "--config.controller.warmup_steps=0",
            "--config.topology.trainer_devices=4",
            "--config.inference.mesh.tensor=2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    assert (
        "topology.trainer_devices (4) + inference.num_workers (1) x inference.mesh (2 "
        "devices) = 6 devices; this host has 4" in done.stderr + done.stdout
    )


def test_relay_chains_name_the_worker_before_then_the_replicas_own_first():
    import dataclasses

    from rlax_tpu.config import RunConfig
    from rlax_tpu.controller.components import relay_sources

    base = RunConfig()

    def config(fanout: str) -> RunConfig:
        return dataclasses.replace(
            base,
            param_server=dataclasses.replace(base.param_server, replicas=2, fanout=fanout),
            controller=dataclasses.replace(
                base.controller,
                param_server_endpoints=("ps0:1", "ps1:1"),
                inference_endpoints=("w0:2", "w1:2", "w2:2"),
            ),
        )

    assert [relay_sources(config("replicas"), k) for k in range(3)] == [()] * 3
    assert [relay_sources(config("relay"), k) for k in range(3)] == [
        ("ps0:1", "ps1:1"),
        ("w0:2", "ps1:1", "ps0:1"),
        ("w1:2", "ps0:1", "ps1:1"),
    ]
