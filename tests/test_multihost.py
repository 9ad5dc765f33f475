"""multihost.broadcast, the lockstep control channel, between two real jax.distributed processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port

WORKER = Path(__file__).with_name("multihost_worker.py")


def _run(scenario: str) -> list[subprocess.CompletedProcess]:
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(pid), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=180)
        finally:
            p.kill()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, text))
    return out


def test_200_payloads_of_any_size_compile_nothing_and_leave_nothing_behind():
    """Seeded sizes from a few bytes to 3 MiB (several chunks), a lead idle longer than a
    follower's read timeout: every payload arrives intact, in order, and no program is compiled
    after warm-up (the old channel compiled a psum per new payload size); the store is empty."""
    for done in _run("sizes"):
        assert done.returncode == 0, done.stdout[-3000:]
        assert "compiles after warm-up: 0; keys left: 0" in done.stdout, done.stdout[-3000:]


def test_a_follower_whose_lead_died_fails_instead_of_waiting_forever():
    lead, follower = _run("lead-dies")
    assert lead.returncode == 3 and "got hello" in follower.stdout, follower.stdout[-3000:]
    assert follower.returncode != 0, follower.stdout[-3000:]
    assert "got a payload from a dead lead" not in follower.stdout
