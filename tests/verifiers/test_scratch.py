"""Scratch directories of verifiers killed with SIGKILL are removed by the next verifier."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rlax_tpu.verifiers import scratch

CHILD = "import sys; from rlax_tpu.verifiers import scratch; print(scratch.make_owned(sys.argv[1]), flush=True); sys.stdin.read()"  # noqa: E501


def test_a_killed_verifiers_scratch_is_swept_and_live_ones_kept(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    theirs = tmp_path / os.path.basename(child.stdout.readline().strip())
    (theirs / "program.bin").write_bytes(b"x" * 1000)
    ours = scratch.make_owned(tmp_path)
    foreign = tmp_path / f"{scratch.PREFIX}no-owner"  # not ours, or still being created
    foreign.mkdir()
    reused = tmp_path / f"{scratch.PREFIX}reused-pid"  # our pid, another process's start time
    reused.mkdir()
    (reused / scratch.OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    assert scratch.sweep_dead(tmp_path) == [reused]  # the child still runs
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert scratch.sweep_dead(tmp_path) == [theirs]
    assert sorted(tmp_path.iterdir()) == sorted([ours, foreign])
    assert (ours / scratch.OWNER_FILE).read_text().split() == [
        str(os.getpid()),
        scratch.process_start(os.getpid()),
    ]
