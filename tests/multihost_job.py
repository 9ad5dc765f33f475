"""Starting ``python -m rlax_tpu.<component>`` as the processes of one jax.distributed job on
127.0.0.1 (CPU, one device per process, gloo), for the multi-host tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.child_env import child_env
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
# How long every process of a job may take to end once one of them was killed (the issue's
# bound: the coordination service's heartbeat timeout, distributed.heartbeat_timeout_s = 20 s,
# plus its detection).
END_BOUND_S = 30


def start(component: str, flags: list[str], per_process: list[list[str]]) -> list[subprocess.Popen]:
    """One process per entry of ``per_process`` (its own flags), all with ``flags``."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = child_env()
    section = f"--config.{component}.distributed"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"rlax_tpu.{component}",
                "--config=configs/codeforces.py:local",
                *flags,
                f"{section}.coordinator_address={coordinator}",
                f"{section}.num_processes={len(per_process)}",
                f"{section}.process_id={pid}",
                *own,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid, own in enumerate(per_process)
    ]


def serving_endpoint(lead: subprocess.Popen) -> str:
    """The address the lead prints once it serves (after gloo's own lines)."""
    line = ""
    while "serving on" not in line and (line := lead.stdout.readline()):
        pass
    assert "serving on 127.0.0.1:" in line, lead.stderr.read()[-3000:]
    return line.split("serving on ", 1)[1].split()[0]


def kill_and_wait(procs: list[subprocess.Popen], victim: int) -> tuple[list[str], float]:
    """SIGKILLs process ``victim``, then waits for every other one to end on its own (at most
    END_BOUND_S after the kill is observed); returns each process's stderr and the seconds the
    last one took to end."""
    procs[victim].kill()
    procs[victim].wait()
    killed = time.monotonic()
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=max(0.1, killed + END_BOUND_S - time.monotonic()))[1])
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"a process outlived its killed peer by {END_BOUND_S} s") from None
    return errs, time.monotonic() - killed


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
