"""Memory of a sandboxed run by what it holds, not by the address space it reserves.

Where this process may create memory cgroups, every run gets a fresh cgroup whose limit bounds all
its processes together (so a fork bomb cannot multiply it) and whose OOM kills decide the verdict;
RLIMIT_AS is then only a generous backstop. cgroup v2 (``memory.max``) is used where this
process's cgroup has the memory controller delegated to it, cgroup v1 (``memory.limit_in_bytes``,
as on this kind of host) otherwise. Elsewhere the run's peak RSS (the launcher's wait4) decides,
under a tighter RLIMIT_AS backstop; start-up logs which.

cgroup v2 allows controllers for children only in a cgroup without processes of its own, so a
verifier alone in its cgroup first moves itself into a leaf (``rlax-verifier-<pid>``) and enables
``+memory`` for the runs beside it; one that shares its cgroup with other processes leaves them
be and judges by peak RSS (run it in a cgroup of its own, e.g. a pod's container or
``systemd-run --scope -p Delegate=yes``).
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
_RUN_PREFIX = "rlax-sandbox-"
_run_numbers = itertools.count()  # process-wide: every sandbox in a process names its runs apart


@dataclasses.dataclass(frozen=True)
class Usage:
    oom_kills: int  # processes the kernel's OOM killer ended for the limit
    limit_hits: int  # charges that met the limit (some reclaim satisfied; the rest OOM-killed)


def _keyed(text: str) -> dict[str, int]:
    """'key value' lines (memory.events, memory.oom_control) -> {key: value}."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _mkdir(path: Path) -> None:
    path.mkdir()  # the kernel fills a new cgroup directory with its interface files


def _rmdir(path: Path) -> None:
    path.rmdir()  # and removes them with it


class RunCgroup:
    """One run's memory cgroup. ``procs`` is the file a process writes its pid to, to join.
    ``limit_bytes`` None: made without a limit, which :meth:`limit` sets before the run."""

    def __init__(self, path: Path, limit_bytes: int | None, *, version: int):
        self.path, self.version = path, version
        _mkdir(path)
        if version == 2:
            # No swap, and an OOM kill ends the whole run (a fork bomb's siblings too).
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (path / name).exists():
                    (path / name).write_text(value)
        if limit_bytes is not None:
            self.limit(limit_bytes)

    def limit(self, limit_bytes: int) -> None:
        """Bounds what the cgroup's processes hold together at ``limit_bytes``."""
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            return
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():  # no swap either: the limit is on memory + swap
            with contextlib.suppress(OSError):  # not settable where swap accounting is off
                swap.write_text(str(limit_bytes))

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def finish(self) -> Usage:
        """The run's usage; removes the cgroup (its processes are gone by now)."""
        if self.version == 2:
            events = _keyed((self.path / "memory.events").read_text())
            usage = Usage(oom_kills=events.get("oom_kill", 0), limit_hits=events.get("max", 0))
        else:
            oom = _keyed((self.path / "memory.oom_control").read_text()).get("oom_kill", 0)
            usage = Usage(oom_kills=oom, limit_hits=int((self.path / "memory.failcnt").read_text()))
        self._remove()
        return usage

    def _remove(self) -> None:
        for delay in (0.0, 0.01, 0.05, 0.2, 1.0):  # exiting processes may linger a moment
            time.sleep(delay)
            try:
                _rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                continue
        log.warning("could not remove the sandbox cgroup %s (still busy)", self.path)


class MemoryCgroups:
    """Creates per-run memory cgroups (cgroup ``version`` 1 or 2) under ``parent``."""

    def __init__(self, parent: Path, *, version: int = 1):
        self.parent, self.version = parent, version

    @classmethod
    def detect(cls) -> MemoryCgroups | None:
        """The host's writable memory cgroups (v2 first), or None (runs judged by peak RSS)."""
        found = []
        with contextlib.suppress(OSError):
            v2 = _v2_parent(
                Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text()
            )
            if v2 is not None:
                found.append(cls(v2, version=2))
        v1 = _v1_parent()
        if v1 is not None:
            found.append(cls(v1, version=1))
        for groups in found:
            try:
                groups.create(64 << 20).finish()  # probe: create, limit, read, remove
            except OSError as e:
                log.info("verifier: cgroup v%d memory unusable (%s)", groups.version, e)
                continue
            return groups
        log.info(
            "verifier: no memory cgroups this process may create; memory is judged by peak RSS"
        )
        return None

    def create(self, limit_bytes: int | None) -> RunCgroup:
        name = f"{_RUN_PREFIX}{os.getpid()}-{next(_run_numbers)}"
        return RunCgroup(self.parent / name, limit_bytes, version=self.version)

    def sweep_dead(self) -> int:
        """Removes the run cgroups of verifiers that no longer run (a SIGKILLed one leaves its
        runs' and waiting shells' cgroups, empty once their processes end); returns how many.
        One still holding a process stays: the kernel refuses to remove it."""
        removed = 0
        for path in self.parent.glob(_RUN_PREFIX + "*"):
            try:
                owner = int(path.name[len(_RUN_PREFIX) :].split("-")[0])
                os.kill(owner, 0)
                continue  # its owner runs (or the pid is reused: left for that owner)
            except ProcessLookupError:
                pass
            except (ValueError, PermissionError):
                continue
            with contextlib.suppress(OSError):
                _rmdir(path)
                removed += 1
        if removed:
            log.info("verifier: removed %d cgroups of verifiers that no longer run", removed)
        return removed


def _v2_parent(mountinfo: str, proc_cgroup: str, *, pid: int | None = None) -> Path | None:
    """The cgroup v2 directory under which this process can make run cgroups with the memory
    controller, setting it up if needed (see the module docstring); None if it cannot.

    mountinfo, proc_cgroup: the texts of /proc/self/mountinfo and /proc/self/cgroup.
    """
    pid = os.getpid() if pid is None else pid
    here = _v2_own_dir(mountinfo, proc_cgroup)
    if here is None or not os.access(here, os.W_OK):
        return None
    try:
        if (
            here.name == f"rlax-verifier-{pid}"
            and "memory" in (here.parent / "cgroup.subtree_control").read_text().split()
        ):  # this process set it up already
            return here.parent
        if "memory" not in (here / "cgroup.controllers").read_text().split():
            return None  # not delegated here (or bound to a v1 hierarchy)
        if "memory" in (here / "cgroup.subtree_control").read_text().split():
            return here
        others = {int(p) for p in (here / "cgroup.procs").read_text().split()} - {pid}
        if others:
            log.info(
                "verifier: cgroup v2 %s holds %d other processes; not moving them to "
                "enable the memory controller",
                here,
                len(others),
            )
            return None
        leaf = here / f"rlax-verifier-{pid}"
        if not leaf.exists():
            _mkdir(leaf)
        (leaf / "cgroup.procs").write_text(str(pid))  # moves every thread of this process
        (here / "cgroup.subtree_control").write_text("+memory")
    except OSError as e:
        log.info("verifier: cannot enable cgroup v2 memory under %s (%s)", here, e)
        return None
    return here


def _v2_own_dir(mountinfo: str, proc_cgroup: str) -> Path | None:
    """This process's cgroup v2 directory, from the mount table and its '0::<path>' line."""
    path = next((line[3:] for line in proc_cgroup.splitlines() if line.startswith("0::")), None)
    if path is None:
        return None
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or fields[sep + 1] != "cgroup2":
            continue
        root, mount_point = fields[3], fields[4]
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return Path(mount_point) / path[len(root.rstrip("/")) :].lstrip("/")
    return None


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
