"""Per-run memory cgroups, cgroup v2 half: finding this process's cgroup from the mount table,
moving itself into a leaf to enable +memory for run cgroups beside it (only when alone),
memory.max / swap / oom.group per run, and the verdict's counts read from memory.events.

FakeCgroupV2 is a fake, named as such: this host's memory controller is bound to its cgroup v1
hierarchy (the v2 hierarchy has no controllers), so the kernel's v2 memory controller cannot run
here. It is a directory tree that behaves as cgroupfs does for what the code touches: mkdir fills
a cgroup with its interface files, rmdir removes them. The kernel enforcing the limit is checked on
v1 by tests/verifiers/test_verifier_problems.py (programs that hold more than the limit get
memory_limit, ones that only reserve it are accepted) through the same sandbox code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlax_tpu.verifiers import memory
from rlax_tpu.verifiers.memory import MemoryCgroups, RunCgroup

PID = 4242
KERNEL_FILES = {
    "cgroup.procs": "",
    "cgroup.controllers": "memory pids",
    "cgroup.subtree_control": "",
    "memory.max": "max",
    "memory.swap.max": "max",
    "memory.oom.group": "0",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
}


class FakeCgroupV2:
    """A fake cgroup2 mount at ``root`` (see the module docstring) with this process in /pod."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        monkeypatch.setattr(memory, "_mkdir", self.mkdir)
        monkeypatch.setattr(memory, "_rmdir", shutil.rmtree)
        self.pod = root / "pod"
        self.mkdir(self.pod)
        (self.pod / "cgroup.procs").write_text(f"{PID}\n")
        self.mountinfo = (
            f"30 25 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n"
            "31 25 0:27 / /proc rw - proc proc rw\n"
        )

    @staticmethod
    def mkdir(path: Path) -> None:
        path.mkdir()
        for name, text in KERNEL_FILES.items():
            (path / name).write_text(text)


def test_this_process_moves_into_a_leaf_and_enables_memory_for_runs(tmp_path, monkeypatch):
    fs = FakeCgroupV2(tmp_path, monkeypatch)
    parent = memory._v2_parent(fs.mountinfo, "0::/pod\n", pid=PID)
    assert parent == fs.pod
    leaf = fs.pod / f"rlax-verifier-{PID}"
    assert (leaf / "cgroup.procs").read_text() == str(PID)
    assert (fs.pod / "cgroup.subtree_control").read_text() == "+memory"
    # Asked again from inside its leaf (a second sandbox in the same process): the same parent.
    (fs.pod / "cgroup.subtree_control").write_text("memory")  # what the kernel then shows
    assert memory._v2_parent(fs.mountinfo, f"0::/pod/rlax-verifier-{PID}\n", pid=PID) == fs.pod
    assert not (leaf / f"rlax-verifier-{PID}").exists()


def test_a_shared_or_undelegated_cgroup_is_left_alone(tmp_path, monkeypatch):
    fs = FakeCgroupV2(tmp_path, monkeypatch)
    (fs.pod / "cgroup.procs").write_text(f"{PID}\n77\n")  # another process shares it
    assert memory._v2_parent(fs.mountinfo, "0::/pod\n", pid=PID) is None
    assert [p.name for p in fs.pod.iterdir() if p.is_dir()] == []  # nothing moved or made
    assert (fs.pod / "cgroup.subtree_control").read_text() == ""
    (fs.pod / "cgroup.procs").write_text(f"{PID}\n")
    (fs.pod / "cgroup.controllers").write_text("hugetlb")  # memory not delegated (this host)
    assert memory._v2_parent(fs.mountinfo, "0::/pod\n", pid=PID) is None
    # No cgroup2 mount, or a cgroup outside it.
    assert memory._v2_parent("31 25 0:27 / /proc rw - proc proc rw\n", "0::/pod\n") is None
    assert memory._v2_own_dir(fs.mountinfo.replace(" / ", " /other "), "0::/pod\n") is None


def test_own_dir_from_a_container_mount_of_a_subtree():
    mountinfo = "40 30 0:26 /kubepods/pod1 /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw\n"
    assert memory._v2_own_dir(mountinfo, "0::/kubepods/pod1/c\n") == Path("/sys/fs/cgroup/c")
    assert memory._v2_own_dir(mountinfo, "0::/kubepods/pod1\n") == Path("/sys/fs/cgroup")
    assert memory._v2_own_dir(mountinfo, "0::/kubepods/pod10\n") is None
    assert memory._v2_own_dir(mountinfo, "4:memory:/x\n") is None  # v1 only


def test_a_run_cgroup_limits_memory_and_reports_oom_kills(tmp_path, monkeypatch):
    fs = FakeCgroupV2(tmp_path, monkeypatch)
    groups = MemoryCgroups(fs.pod, version=2)
    run = groups.create(256 << 20)
    assert isinstance(run, RunCgroup) and run.path.parent == fs.pod
    assert run.procs == run.path / "cgroup.procs"
    assert (run.path / "memory.max").read_text() == str(256 << 20)
    assert (run.path / "memory.swap.max").read_text() == "0"
    assert (run.path / "memory.oom.group").read_text() == "1"
    # The kernel counted 3 charges at the limit and one OOM kill.
    (run.path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    usage = run.finish()
    assert (usage.oom_kills, usage.limit_hits) == (1, 3)
    assert not run.path.exists()
    # Run names are unique within the process, across its sandboxes too.
    a, b = groups.create(1 << 20), MemoryCgroups(fs.pod, version=2).create(1 << 20)
    assert a.path != b.path
    assert a.finish().oom_kills == 0 and b.finish().limit_hits == 0


def test_a_start_removes_the_cgroups_of_verifiers_that_no_longer_run(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_rmdir", os.rmdir)
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    for name in (f"rlax-sandbox-{gone.pid}-0", f"rlax-sandbox-{gone.pid}-7"):
        (tmp_path / name).mkdir()
    kept = [f"rlax-sandbox-{os.getpid()}-0", "rlax-sandbox-x-1", "rlax-verifier-1"]
    for name in kept:
        (tmp_path / name).mkdir()
    busy = tmp_path / f"rlax-sandbox-{gone.pid}-9"  # a process still in it: the kernel refuses
    busy.mkdir()
    (busy / "cgroup.procs").write_text("12\n")
    assert MemoryCgroups(tmp_path).sweep_dead() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, busy.name])
