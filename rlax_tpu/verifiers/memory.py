"""Memory of a sandboxed run by what it holds, not by the address space it reserves.

Where this process may create memory cgroups (cgroup v1's memory controller, as on this kind of
host), every run gets a fresh cgroup whose limit bounds all its processes together (so a fork bomb
cannot multiply it) and whose OOM kills decide the verdict; RLIMIT_AS is then only
a generous backstop. Elsewhere the run's peak RSS (the launcher's wait4) decides, under a tighter
RLIMIT_AS backstop. cgroup v2 (memory.max) is not used yet: hosts with only v2 take the peak-RSS
path (logged once at start-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

# What the sandbox's own processes (the shell that joins the cgroup, bwrap, the launcher) hold
# inside a run's cgroup besides the program.
SANDBOX_OVERHEAD_BYTES = 8 << 20
_V1_ROOT = Path("/sys/fs/cgroup/memory")


@dataclasses.dataclass(frozen=True)
class Usage:
    oom_kills: int  # processes the kernel's OOM killer ended for the limit
    limit_hits: int  # charges that met the limit (some reclaim satisfied; the rest OOM-killed)


class RunCgroup:
    """One run's memory cgroup (v1). ``procs`` is the file a process writes its pid to, to join."""

    def __init__(self, path: Path, limit_bytes: int):
        self.path = path
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():  # no swap either: the limit is on memory + swap
            with contextlib.suppress(OSError):  # not settable where swap accounting is off
                swap.write_text(str(limit_bytes))

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def finish(self) -> Usage:
        """The run's usage; removes the cgroup (its processes are gone by now)."""
        oom = 0
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                oom = int(value)
        hits = int((self.path / "memory.failcnt").read_text())
        self._remove()
        return Usage(oom_kills=oom, limit_hits=hits)

    def _remove(self) -> None:
        for delay in (0.0, 0.01, 0.05, 0.2, 1.0):  # exiting processes may linger a moment
            time.sleep(delay)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                continue
        log.warning("could not remove the sandbox cgroup %s (still busy)", self.path)


class MemoryCgroups:
    """Creates per-run memory cgroups under this process's own (v1) memory cgroup."""

    def __init__(self, parent: Path):
        self.parent = parent
        self._names = itertools.count()

    @classmethod
    def detect(cls) -> MemoryCgroups | None:
        """The host's writable memory cgroups, or None (then runs are judged by peak RSS)."""
        parent = _v1_parent()
        if parent is None:
            if Path("/sys/fs/cgroup/cgroup.controllers").exists():
                log.info("verifier: cgroup v2 is not used yet; memory is judged by peak RSS")
            return None
        probe = cls(parent)
        try:
            group = probe.create(64 << 20)
            group.finish()
        except OSError as e:
            log.info("verifier: memory cgroups unusable (%s); memory is judged by peak RSS", e)
            return None
        return probe

    def create(self, limit_bytes: int) -> RunCgroup:
        name = f"rlax-sandbox-{os.getpid()}-{next(self._names)}"
        return RunCgroup(self.parent / name, limit_bytes)


def _v1_parent() -> Path | None:
    if not (_V1_ROOT / "memory.limit_in_bytes").exists():
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            parent = _V1_ROOT / path.lstrip("/")
            return parent if os.access(parent, os.W_OK) else None
    return None
