"""Runs made ready ahead: a shell per future run, waiting in that run's own fresh memory cgroup
(the cgroup migration, an RCU grace period, leaves the run's path); closing leaves nothing."""

from __future__ import annotations

import time
from pathlib import Path

from rlax_tpu.verifiers.sandbox import READY_PER_SLOT, Limits, Sandbox
from tests.verifiers.conftest import session_uid_base

LIMITS = Limits(cpu_time_s=1, wall_time_s=5, memory_bytes=64 << 20, output_bytes=1 << 16)


def made(tmp_path: Path, slots: int = 2) -> Sandbox:
    sandbox = Sandbox(uid_base=session_uid_base() + 10, slots=slots, scratch_dir=tmp_path)
    for _ in range(200):  # made in the background
        if len(sandbox._ready) == READY_PER_SLOT * slots:
            return sandbox
        time.sleep(0.05)
    raise AssertionError(f"{len(sandbox._ready)} runs ready, {READY_PER_SLOT * slots} expected")


def test_runs_wait_ready_in_their_own_cgroups_and_close_leaves_nothing(tmp_path):
    sandbox = made(tmp_path)
    ready = list(sandbox._ready)
    assert all(r.proc.poll() is None for r in ready)  # waiting for their command
    groups = [r.group for r in ready if r.group is not None]
    if sandbox.memory_cgroups is not None:  # each shell is in its own run's cgroup already
        assert len({g.path for g in groups}) == len(ready)
        for r in ready:
            assert r.group.procs.read_text().split() == [str(r.proc.pid)]
    out = sandbox.run(["/bin/sh", "-c", "echo hello"], limits=LIMITS)
    assert out.ok and out.stdout == b"hello\n", out
    first = ready[0]
    assert first.proc.returncode is not None and not first.run_dir.exists()
    assert first.group is None or not first.group.path.exists()  # the run's cgroup is gone
    sandbox.close()
    assert all(r.proc.poll() is not None for r in ready + list(sandbox._ready))
    assert not any(g.path.exists() for g in groups)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run-")] == []


def test_a_ready_shell_that_died_is_passed_over(tmp_path):
    sandbox = made(tmp_path, slots=1)
    gone = sandbox._ready[0]
    gone.proc.kill()
    gone.proc.wait()
    assert sandbox.run(["/bin/true"], limits=LIMITS).ok
    assert not gone.run_dir.exists() and gone not in sandbox._ready
    # One that dies between being taken and its run: that run fails, saying so; the next runs.
    taken = sandbox._take()
    taken.proc.kill()
    taken.proc.wait()
    out = sandbox._run(taken, sandbox.uid_base, ["/bin/true"], LIMITS, (), None, "/work", None, ())
    assert not out.ok and out.error.startswith("sandbox failed"), out
    assert sandbox.run(["/bin/true"], limits=LIMITS).ok
    sandbox.close()
