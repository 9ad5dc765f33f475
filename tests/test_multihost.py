"""multihost.broadcast, the lockstep control channel, and the failure rule (multihost.agree,
multihost.fail and the watchdog), between two real jax.distributed processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu import multihost
from rlax_tpu.config import ConfigError, DistributedConfig
from tests.conftest import free_port

WORKER = Path(__file__).with_name("multihost_worker.py")


def _start(scenario: str) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(pid), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]


def _run(scenario: str) -> list[subprocess.CompletedProcess]:
    procs = _start(scenario)
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


def test_a_call_that_failed_on_one_process_ends_both_naming_it():
    """Trainer lockstep over a stand-in trainer: a restore that fails on both processes is the
    lead caller's error and both go on; a save that fails on process 1 alone (its directory
    does not exist there) ends both, each saying which process failed and why."""
    lead, follower = _run("lockstep")
    assert "restore failed on every process: No such file or directory" in lead.stdout
    # The coordination service (no credentials; pickled commands in its store) listens only
    # where its loopback coordinator address says, not on every interface (JAX's [::]:port).
    assert "coordinator listens on ['127.0.0.1']" in lead.stdout, lead.stdout[-3000:]
    for done in (lead, follower):
        assert done.returncode != 0, done.stdout[-3000:]
        assert "trainer call save failed on process 1: FileNotFoundError" in done.stdout
        assert "went on" not in done.stdout


def test_a_failed_process_ends_one_waiting_in_a_collective_it_never_entered():
    """Process 1's call fails while process 0 waits in a device collective process 1 never
    enters: process 1 waits for the others' word at most the heartbeat timeout (5 s here), then
    ends the job; process 0's watchdog ends it within 30 s, naming process 1's error."""
    lead, follower = _start("blocked")
    try:
        out = [follower.communicate(timeout=180)[0]]
        out.insert(0, lead.communicate(timeout=30)[0])
    finally:
        for p in (lead, follower):
            p.kill()
            p.wait()
    assert "entering a collective" in out[0], out[0][-3000:]
    for p, text in zip((lead, follower), out, strict=True):
        assert p.returncode != 0, text[-3000:]
        assert "trainer call save failed on process 1: FileNotFoundError" in text, text[-3000:]
        assert "got past" not in text


def test_a_process_alive_but_stuck_ends_the_job_within_the_call_timeout():
    """[pod-fidelity]: process 1 hangs in a train step, alive (its heartbeat thread runs on, so
    the coordination service sees nothing; a frozen process is its heartbeats' case), while
    process 0 waits for it in a device collective. The call outlives distributed.call_timeout_s
    (3 s here) on both: both exit EXIT_FAILED naming it, process 1 while still in its sleep
    (300 s, beyond this test's wait: ending at all is the bound)."""
    lead, follower = _run("stuck")
    assert "process 1 hangs in its step" in follower.stdout, follower.stdout[-3000:]
    for done in (lead, follower):
        assert done.returncode == multihost.EXIT_FAILED, done.stdout[-3000:]
        assert "trainer call train_step has not ended after 3 s (distributed.call_timeout_s)" in (
            done.stdout
        ), done.stdout[-3000:]
        assert "got past the stuck step" not in done.stdout


def test_the_call_timeout_may_be_zero_but_not_negative():
    assert DistributedConfig(call_timeout_s=0).call_timeout_s == 0
    with pytest.raises(ConfigError, match="call_timeout_s"):
        DistributedConfig(call_timeout_s=-1)


def test_the_coordinator_binds_where_its_address_says():
    assert multihost.coordinator_bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert multihost.coordinator_bind_address("localhost:1234") == "127.0.0.1:1234"
    assert multihost.coordinator_bind_address("10.0.0.5:80") == "10.0.0.5:80"
    assert multihost.coordinator_bind_address("[::1]:80") == "[::1]:80"
    assert multihost.coordinator_bind_address("trainer-0.rlax:80") is None  # JAX's default


def test_the_heartbeat_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        DistributedConfig(heartbeat_timeout_s=0)
