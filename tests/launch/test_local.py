"""`python -m rlax_tpu.launch`: the local preset's topology as processes, run to the end, resumed,
stopped by a signal or by a dying service, and nothing left running afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlax_tpu.launch.local import launched_pids
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
LAUNCH_ID = re.compile(r"\(launch id ([0-9a-f]+)\)")


def _env() -> dict[str, str]:
    # One CPU device per process (conftest forces 8 for in-process tests).
    return child_env()


def _tiny(run_dir: Path, steps: int) -> list[str]:
    uid = 1_900_000 + (os.getpid() % 50_000) * 8
    return [
        "--config=configs/codeforces.py:local",
        f"--config.controller.run_dir={run_dir}",
        f"--config.controller.num_steps={steps}",
        "--config.controller.prompts_per_step=2",
        "--config.algorithm.group_size=2",
        "--config.trainer.micro_batch_size=4",
        "--config.model.num_layers=1",
        "--config.inference.max_new_tokens=16",
        "--config.inference.max_concurrent_seqs=8",
        "--config.data.eval_problems=4",
        "--config.data.eval_samples=2",
        "--config.controller.warmup_steps=10",
        f"--config.verifiers.sandbox_uid={uid}",
    ]


def _launch(args: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlax_tpu.launch", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _launch_id(stdout: str) -> str:
    m = LAUNCH_ID.search(stdout)
    assert m, stdout[-3000:]
    return m.group(1)


@pytest.mark.slow
def test_the_local_topology_runs_to_the_end_resumes_and_leaves_nothing_behind(tmp_path):
    """Two parameter-server replicas, a trainer of two jax.distributed processes emulating two
    single-host slices, two inference workers receiving each version over a relay chain
    (``param_server.fanout`` "relay": the second from the first, the first from the parameter
    server), the verifiers and the controller, each its own process: the warm-up runs first and
    the services start from its weights; a second launch with more steps resumes the run. (Two
    slices of two processes each, against one process: tests/trainer/test_distributed.py; the
    relay's bytes and failover: tests/param_server/test_relay.py.)

    Cost: about 60 CPU-s, the nine processes of a launch (their imports, the tiny model's
    compiles) twice: a launch and its resume, each a claim of its own."""
    run_dir = tmp_path / "run"
    topology = [
        "--config.param_server.replicas=2",
        "--config.trainer.distributed.coordinator_address=auto",
        "--config.trainer.distributed.num_processes=2",
        # A busy 2-core host once starved both processes' heartbeats past the 20 s default in a
        # clean `make test` (both reported unhealthy at once, no process at fault); what this
        # test observes does not depend on how fast a dead process is found.
        "--config.trainer.distributed.heartbeat_timeout_s=60",
        "--config.mesh.slices=2",
        # π_old in one pass (the CPU default replays it token by token, a collective across
        # the two trainer processes a token); what this test observes does not depend on it.
        "--config.trainer.old_logprobs=prefill",
        "--config.inference.num_workers=2",
        "--config.param_server.fanout=relay",
    ]
    done = _launch([*_tiny(run_dir, 2), *topology])
    out = done.stdout
    assert done.returncode == 0, out[-5000:] + done.stderr[-3000:]
    assert "run finished: 2 updates (version 2)" in out, out[-3000:]
    assert launched_pids(_launch_id(out)) == []
    for name in (
        "warmup",
        "param_server-0",
        "param_server-1",
        "trainer.0",
        "trainer.1",
        "inference-0",
        "inference-1",
        "verifiers",
        "controller",
    ):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    # The services ran apart, over gRPC, from the warmed-up weights.
    assert "distributed transport" in out
    assert (run_dir / "warmup" / "config.json").is_file()
    assert "supervised warm-up of 10 steps" in (run_dir / "report.md").read_text()
    relayed = re.compile(
        r"over the relay (\d+) \(\d+ as deltas, \d+ bytes\), pulled (\d+); (\d+) bytes"
    )
    workers = [(run_dir / "logs" / f"inference-{i}.log").read_text() for i in (0, 1)]
    for log in workers:
        assert "or the worker before this one (a relay chain)" in log, log[-2000:]
    # Every version either worker loaded came over the relay (none pulled), and the first
    # passed versions on to the second.
    counts = [tuple(int(x) for x in relayed.search(log).groups()) for log in workers]
    assert all(n >= 1 and pulled == 0 for n, pulled, _ in counts), counts
    assert counts[0][2] > 0 and counts[1][2] == 0, counts
    # The controller's summary counts what the loads took over the network (the LoadWeights
    # replies): every relayed load's bytes.
    wire = re.search(r"weights over the network: ([\d.]+) MiB in (\d+) loads", out)
    assert wire and float(wire[1]) > 0 and int(wire[2]) >= 2, out[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.0.log").read_text()
    assert "serving on 127.0.0.1:" in trainer_log
    # 2 processes of one CPU device: per slice fsdp 1 (the preset's fsdp=-1), data 2 across.
    assert (
        "process 0 of 2 (slice 0), mesh data 2 x fsdp 1 x expert 1 x tensor 1 over 2 slices"
    ) in trainer_log
    log = (run_dir / "logs" / "trainer.1.log").read_text()
    assert "process 1 of 2 (slice 1)" in log, log[-2000:]
    assert "follower stopped" in log, log[-2000:]
    # Each replica persisted what it received, apart.
    for r in (0, 1):
        assert any((run_dir / "param_server" / f"replica-{r}").iterdir())

    again = _launch([*_tiny(run_dir, 3), *topology])
    out = again.stdout
    assert again.returncode == 0, out[-5000:] + again.stderr[-3000:]
    assert "reusing the warm-up" in out
    assert "run finished: 3 updates (version 3)" in out, out[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    updates = [r["step"] for r in records if "reward/mean" in r["scalars"]]
    assert updates == [1, 2, 3]  # nothing lost, nothing repeated
    assert launched_pids(_launch_id(out)) == []


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rlax_tpu.launch", *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float = 300) -> str:
    seen = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"no {marker!r}:\n{''.join(seen)[-4000:]}")


def test_sigterm_stops_every_process(tmp_path):
    proc = _start([*_tiny(tmp_path / "run", 1000), "--config.controller.warmup_steps=0"])
    try:
        head = _read_until(proc, "step 1/1000")
        launch_id = _launch_id(head)
        assert len(launched_pids(launch_id)) >= 5  # 4 services and the controller
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "SIGTERM: stopping every process" in rest, rest[-3000:]
    assert launched_pids(launch_id) == []


def test_a_service_that_dies_stops_the_run(tmp_path):
    proc = _start([*_tiny(tmp_path / "run", 1000), "--config.controller.warmup_steps=0"])
    try:
        head = _read_until(proc, "step 1/1000")
        launch_id = _launch_id(head)
        worker = next(
            p
            for p in launched_pids(launch_id)
            if b"rlax_tpu.inference" in Path(f"/proc/{p}/cmdline").read_bytes()
        )
        os.kill(worker, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, rest[-3000:]
    assert "inference-0 exited with status -9 during the run" in rest, rest[-3000:]
    assert launched_pids(launch_id) == []


def test_a_service_that_cannot_start_fails_the_launch_with_its_reason(tmp_path):
    done = _launch(
        [
            *_tiny(tmp_path / "run", 2),
            "--config.controller.warmup_steps=0",
            "--config.inference.backend=gpu",
        ],
        timeout_s=300,
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert "inference-0 exited with status" in done.stdout and "before it served" in done.stdout
    assert launched_pids(_launch_id(done.stdout)) == []
