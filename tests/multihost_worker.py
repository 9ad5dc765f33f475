"""Subprocess for test_multihost: one of two jax.distributed processes (CPU) exchanging lockstep
messages through multihost.broadcast.

    python tests/multihost_worker.py COORDINATOR PROCESS_ID SCENARIO

SCENARIO "sizes": 200 payloads of seeded random sizes (0 to 3 MiB: one key to four chunks), the
lead idle for a while before one of them and failing to send an unpicklable one; prints the
compilations after warm-up and what is left in the store. "lead-dies": the lead exits after one payload; the follower waits for the next.

The failure rule (multihost.initialize: its watchdog, heartbeat timeout 5 s). "lockstep": a
LeadTrainer and a follower over a stand-in trainer that writes files: a restore that fails on
both processes is the lead's caller's error and both go on; a save into a directory that exists
only on the lead fails on process 1 alone and ends both. "blocked": process 1's call fails while
process 0 waits in a device collective process 1 never enters. "stuck": a train step (call
timeout 3 s) in which process 1 sleeps for 300 s, alive, while process 0 waits for it in a
device collective.
"""

import contextlib
import ipaddress
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.child_env import xla_flags  # noqa: E402

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from rlax_tpu import multihost  # noqa: E402
from rlax_tpu.config import DistributedConfig  # noqa: E402
from rlax_tpu.trainer.lockstep import LeadTrainer, follow  # noqa: E402

STEPS = 200


class Files:
    """A stand-in trainer: its calls read and write files in ``where``."""

    def __init__(self, where: Path):
        self.where = where

    def save(self) -> None:
        (self.where / "state").write_text("saved")

    def restore(self) -> str:
        return (self.where / "never-saved").read_text()


class Stuck:
    """A stand-in trainer whose step hangs on process 1 (alive: its heartbeats go on) while
    process 0 waits for it in a device collective."""

    def train_step(self) -> None:
        if jax.process_index() == 1:
            print("process 1 hangs in its step", flush=True)
            time.sleep(300)
        else:
            multihost_utils.process_allgather(np.ones(2))
        print("got past the stuck step", flush=True)


def failure_rule(coordinator: str, pid: int, scenario: str) -> None:
    multihost.initialize(
        DistributedConfig(
            coordinator_address=coordinator,
            num_processes=2,
            process_id=pid,
            heartbeat_timeout_s=5,
            call_timeout_s=3 if scenario == "stuck" else 1800,
        )
    )
    if scenario == "stuck":
        if pid == 1:
            follow(Stuck())
        else:
            LeadTrainer(Stuck()).train_step()
        print("got past the stuck step", flush=True)
        return
    if pid == 0:
        port = int(coordinator.rsplit(":", 1)[1])
        print(f"coordinator listens on {listening(port)}", flush=True)
    # A real directory on the lead only: process 1's save fails there, and only there.
    where = Path(tempfile.mkdtemp()) if pid == 0 else Path("/nonexistent/rlax-test")
    if scenario == "blocked":
        if pid == 1:
            try:
                Files(where).save()
            except OSError as e:
                multihost.agree("trainer call save", e)  # must not return
        else:
            print("entering a collective process 1 never enters", flush=True)
            multihost_utils.process_allgather(np.ones(2))
        print("got past a collective a process never entered", flush=True)
        return
    if pid == 1:
        follow(Files(where))
        print("the follower went on after its save failed alone", flush=True)
        return
    lead = LeadTrainer(Files(where))
    try:
        lead.restore()
    except FileNotFoundError as e:
        print(f"restore failed on every process: {e.strerror}", flush=True)
    lead.save()
    print("the lead went on after the follower's save failed", flush=True)


def listening(port: int) -> list[str]:
    """The local addresses of this machine's TCP sockets listening on ``port`` (from /proc;
    IPv4-mapped IPv6 addresses as IPv4)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                raw = bytes.fromhex(addr)
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # host order
                ip = b"".join(words)
                v6 = ipaddress.IPv6Address(ip) if width == 32 else None
                found.append(str(ipaddress.IPv4Address(ip) if v6 is None else v6.ipv4_mapped or v6))
    return sorted(found)


def payload(step: int) -> dict:
    rng = np.random.default_rng(step)
    size = int(rng.integers(0, 3 * 2**20)) if step % 3 else int(rng.integers(0, 200))
    return {"step": step, "data": rng.integers(0, 256, size, dtype=np.uint8)}


def main() -> None:
    coordinator, pid, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if scenario in ("lockstep", "blocked", "stuck"):
        failure_rule(coordinator, pid, scenario)
        return
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    lead = pid == 0
    multihost._WAIT_MS = 200  # so the idle wait below loops through several timeouts
    if scenario == "lead-dies":
        got = multihost.broadcast("hello" if lead else None)
        print(f"got {got}", flush=True)
        multihost._client().wait_at_barrier("rlax-test-hello", 60_000)
        if lead:
            os._exit(3)  # while the follower waits for the next payload
        multihost.broadcast(None)  # the lead is gone: this must fail, not hang
        print("the follower got a payload from a dead lead", flush=True)
        return
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if "compile" in event else None
    )
    jax.numpy.zeros(4).block_until_ready()  # warm-up: the process's own first programs
    compiles.clear()
    for step in range(STEPS):
        if lead and step == 7:
            time.sleep(1.5)  # idle: the follower waits on the host meanwhile
        if lead and step == 50:
            # A payload that cannot be sent: the followers' next one is still this step's.
            with contextlib.suppress(AttributeError, pickle.PicklingError):
                multihost.broadcast(lambda: None)
        got = multihost.broadcast(payload(step) if lead else None)
        want = payload(step)
        assert got["step"] == step and np.array_equal(got["data"], want["data"]), step
    client = multihost._client()
    # The lead never waits for a follower's read, so on a loaded host (CI) a follower ended more
    # than 60 s after it: the bound is the test's own 180 s, not a speed claim.
    client.wait_at_barrier("rlax-test-done", 170_000)
    left = client.key_value_dir_get_bytes(multihost._PREFIX)
    print(f"compiles after warm-up: {len(compiles)}; keys left: {len(left)}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
