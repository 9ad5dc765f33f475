"""Runs untrusted programs in bubblewrap sandboxes (DESIGN.md §9, RLAX §6.1).

Each run gets fresh pid, network, ipc, uts and cgroup namespaces and a mount namespace that holds
only read-only system directories, the toolchains, the mounts the caller names (read-only unless
marked writable) and private, size-limited tmpfs ``/work`` and ``/tmp``. No network (only a
loopback that is down), no host environment, no host /proc. Inside, ``launcher.cpp`` (root with
only CAP_SETUID/CAP_SETGID/CAP_KILL) applies rlimits, drops to the slot's non-root uid and supervises the
program: wall-clock limit, whole-tree kill, exact exit status and CPU time. stdout and stderr go to
host files whose size RLIMIT_FSIZE caps. If the service itself dies, ``--die-with-parent`` takes the
sandbox with it.

Concurrent runs use distinct uids (``uid_base + slot``): RLIMIT_NPROC counts processes per uid, so a
fork bomb in one slot cannot starve another.

Runs are made ready ahead, in the background (up to READY_PER_SLOT per slot): a scratch directory,
a status pipe and a shell already in the run's own fresh memory cgroup, waiting for its bubblewrap
command. Moving a process into a cgroup waits for an RCU grace period and holds back every fork on
the host meanwhile (cgroup v1 here: a run took 18.6 ms with its move, 9.5 ms with it made ahead,
8.5 ms with no cgroup; benchmarks/verifier_throughput.py); moves made in bursts share one.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import queue
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path

from rlax_tpu.verifiers import seccomp
from rlax_tpu.verifiers.memory import SANDBOX_OVERHEAD_BYTES, MemoryCgroups, RunCgroup

log = logging.getLogger(__name__)

_LAUNCHER_SOURCE = Path(__file__).with_name("launcher.cpp")
_LAUNCHER_IN_SANDBOX = "/.launcher"
_STDERR_KEPT = 4096
# System paths visible (read-only) in every sandbox; /etc only in part: nothing that names hosts,
# users or secrets, just what the dynamic loader, `cc` and the JDK look up.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ENTRIES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
ETC_GLOBS = ("java-*",)
DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}


class SandboxUnavailable(RuntimeError):
    """bubblewrap or a C++ compiler for the launcher is missing, or we cannot switch uids."""


UNLIMITED_STACK = -1  # Limits.stack_bytes: see there
CGROUP_ADDRESS_SPACE_FACTOR = 16  # RLIMIT_AS backstop / memory limit, when a cgroup bounds the run
RSS_ADDRESS_SPACE_FACTOR = 2  # ... when only the peak RSS is judged (it bounds what a run holds)
READY_PER_SLOT = 4  # runs made ahead per slot (each a waiting shell and an empty cgroup)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-run limits; processes count threads too.

    Memory is what the run holds (``verifiers.memory``): with memory cgroups, the run's processes
    together, enforced by the kernel (the OOM killer); without, the program's peak RSS, judged
    after the run. RLIMIT_AS is only a backstop, ``address_space_bytes`` or a multiple of
    ``memory_bytes`` (CGROUP_/RSS_ADDRESS_SPACE_FACTOR, whichever is larger), so runtimes that
    reserve address space (thread stacks, malloc arenas, the JVM) run as they would on a judge.
    Without cgroups a fork bomb is bounded by ``processes`` times that backstop, so
    ``processes`` stays small.
    """

    cpu_time_s: float
    wall_time_s: float
    memory_bytes: int
    address_space_bytes: int = 0
    output_bytes: int  # RLIMIT_FSIZE: stdout, stderr and every file the program writes
    disk_bytes: int = 64 << 20  # size of each of the private tmpfs /work and /tmp
    processes: int = 8  # programs; languages.Language.processes (the JVM needs more threads)
    open_files: int = 128
    # UNLIMITED_STACK: the main thread's stack may still grow to the memory limit (RLIMIT_AS
    # bounds it, as Codeforces gives the stack the whole limit), while new threads get glibc's
    # default 8 MiB stack: a finite stack limit is also every thread's stack size, and each
    # thread then reserves that much of RLIMIT_AS (one thread at 256 MB failed).
    stack_bytes: int = UNLIMITED_STACK


def _stack_arg(limits: Limits) -> str:
    return "unlimited" if limits.stack_bytes == UNLIMITED_STACK else str(limits.stack_bytes)


@dataclasses.dataclass(frozen=True)
class Mount:
    source: Path
    target: str  # absolute path inside the sandbox
    writable: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    exit_code: int | None  # None: killed by a signal (or the run never started)
    signal: int  # 0: none
    cpu_time_s: float
    wall_time_s: float
    max_rss_bytes: int
    timed_out: bool  # the wall-clock limit killed it
    stdout: bytes
    stderr: bytes  # the last few KiB
    error: str = ""  # the sandbox failed (not the program): an internal error
    over_memory: bool = False  # killed for the memory limit, or held more than it

    @property
    def ok(self) -> bool:
        return not self.error and self.exit_code == 0 and not self.timed_out


@dataclasses.dataclass
class _Ready:
    """A run made ready ahead: ``proc`` is a shell (already in ``group``) that reads a line on
    stdin, then runs ``<run_dir>/command`` (an ``exec`` of bubblewrap)."""

    proc: subprocess.Popen
    group: RunCgroup | None
    run_dir: Path
    status_r: int  # the launcher's status line arrives here
    status_fd: int  # its write end's number in the shell (and bubblewrap, the launcher)
    filter_fd: int | None  # the seccomp filter's pipe, for bubblewrap's --seccomp

    def discard(self) -> None:
        """Ends the waiting shell (EOF on its stdin) and removes what was made for the run."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.status_r)
        if self.group is not None:
            self.group.finish()
        shutil.rmtree(self.run_dir, ignore_errors=True)


# $0: the cgroup's procs file; $1: the command file, written when the run starts.
_WAIT = 'read -r go || exit 125; . "$1"'
_JOIN_AND_WAIT = 'echo $$ > "$0" || exit 125; ' + _WAIT


def _parse_status(line: str) -> dict[str, int]:
    fields = dict(part.split("=", 1) for part in line.split())
    return {k: int(v) for k, v in fields.items()}


class Sandbox:
    """A pool of ``slots`` sandbox uids; ``run`` blocks until a slot is free."""

    def __init__(
        self,
        *,
        uid_base: int,
        slots: int,
        scratch_dir: Path,
        toolchain_mounts: Sequence[Mount] = (),
        use_seccomp: bool = True,
        memory_cgroups: bool = True,
    ):
        """``memory_cgroups``: bound each run with a memory cgroup where the host allows it
        (False: judge the peak RSS only)."""
        self._bwrap = shutil.which("bwrap")
        if self._bwrap is None:
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed; `make` installs it")
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "the verifier sandbox needs root (or CAP_SETUID/CAP_SETGID/CAP_SYS_ADMIN) to run "
                "untrusted code under its own non-root uids"
            )
        if uid_base <= 0:
            raise ValueError(f"uid_base must be > 0, got {uid_base}")
        self.uid_base, self.slots = uid_base, slots
        self._scratch = Path(scratch_dir)
        self._scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._launcher = self._build_launcher()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(slots):
            self._free.put(uid_base + slot)
        self._seccomp = seccomp.build_filter() if use_seccomp and seccomp.supported() else None
        self._fixed_args = self._system_args(toolchain_mounts)
        self.memory_cgroups = MemoryCgroups.detect() if memory_cgroups else None
        if self.memory_cgroups is not None:
            self.memory_cgroups.sweep_dead()
        self._lock = threading.Lock()
        self._closed = False
        self._ready: collections.deque[_Ready] = collections.deque()
        self._readier = futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-ready")
        self._refill()

    @property
    def uids(self) -> range:
        return range(self.uid_base, self.uid_base + self.slots)

    def _build_launcher(self) -> Path:
        source = _LAUNCHER_SOURCE.read_bytes()
        out = self._scratch / f"launcher-{hashlib.sha256(source).hexdigest()[:16]}"
        if out.exists():
            return out
        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise SandboxUnavailable("a C++ compiler (g++) is needed to build the sandbox launcher")
        tmp = out.with_suffix(".tmp")
        done = subprocess.run(
            [compiler, "-O2", "-o", str(tmp), str(_LAUNCHER_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise SandboxUnavailable(f"building the sandbox launcher failed: {done.stderr[-2000:]}")
        tmp.chmod(0o755)
        tmp.rename(out)
        return out

    def _system_args(self, toolchain_mounts: Sequence[Mount]) -> list[str]:
        args = [
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            # The launcher needs these to drop to the sandbox uid and to kill what it leaves.
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            "--cap-add",
            "CAP_KILL",
            "--hostname",
            "sandbox",
        ]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        args += ["--perms", "0755", "--dir", "/etc"]
        etc = [Path("/etc", e) for e in ETC_ENTRIES]
        etc += [p for g in ETC_GLOBS for p in sorted(Path("/etc").glob(g))]
        for p in etc:
            if p.exists():
                args += ["--ro-bind", str(p), str(p)]
        args += self._mount_args(toolchain_mounts, created={"/", "/etc"})
        args += ["--ro-bind", str(self._launcher), _LAUNCHER_IN_SANDBOX]
        args += ["--proc", "/proc", "--dev", "/dev", "--clearenv"]
        return args

    @staticmethod
    def _mount_args(mounts: Sequence[Mount], created: set[str]) -> list[str]:
        args: list[str] = []
        for m in mounts:
            # bwrap makes missing parents with mode 0700, which the sandbox uid could not enter.
            for parent in reversed(Path(m.target).parents):
                p = str(parent)
                if p not in created:
                    created.add(p)
                    args += ["--perms", "0755", "--dir", p]
            args += ["--bind" if m.writable else "--ro-bind", str(m.source), m.target]
        return args

    def run(
        self,
        argv: Sequence[str],
        *,
        limits: Limits,
        mounts: Sequence[Mount] = (),
        stdin: str | None = None,
        cwd: str = "/work",
        env: Mapping[str, str] | None = None,
        writable_dirs: Sequence[Path] = (),
    ) -> RunResult:
        """Runs ``argv`` (paths as seen inside the sandbox) and returns its outcome.

        ``stdin`` is a path inside the sandbox (usually a read-only mount). ``writable_dirs`` are
        host directories among ``mounts`` that the sandbox uid must be able to write; they are
        handed to it for the run and taken back afterwards.
        """
        uid = self._free.get()
        try:
            ready = self._take()
            return self._run(ready, uid, argv, limits, mounts, stdin, cwd, env, writable_dirs)
        finally:
            self._free.put(uid)
            self._refill()

    def close(self) -> None:
        """Ends the waiting shells and removes their cgroups and directories."""
        with self._lock:
            self._closed = True
        self._readier.shutdown(wait=True)
        with self._lock:
            ready, self._ready = list(self._ready), collections.deque()
        for r in ready:
            r.discard()

    def _take(self) -> _Ready:
        """A run made ready ahead (made now if none is), and more made in the background."""
        while True:
            with self._lock:
                ready = self._ready.popleft() if self._ready else None
            if ready is None or ready.proc.poll() is None:
                break
            ready.discard()  # its shell is gone (killed from outside): not this run's failure
        return ready if ready is not None else self._prepare()

    def _refill(self) -> None:
        """Tops the made runs up to READY_PER_SLOT per slot once at most one per slot is left,
        after a run: a move into a cgroup holds back every fork on the host until its grace
        period ends, so moves are few (one grace period covers a burst) and not inside a run."""
        with self._lock:
            if not self._closed and len(self._ready) <= self.slots:
                self._readier.submit(self._fill)

    def _fill(self) -> None:
        while True:
            with self._lock:
                if self._closed or len(self._ready) >= READY_PER_SLOT * self.slots:
                    return
            try:
                ready = self._prepare()
            except Exception as e:  # a run makes its own then, and raises this where it is seen
                log.warning("sandbox: could not make a run ready ahead: %s", e)
                return
            with self._lock:
                if self._closed:
                    break
                self._ready.append(ready)
        ready.discard()

    def _prepare(self) -> _Ready:
        """A run made ready: its directory with the stdout and stderr files, its status pipe,
        the seccomp filter in a pipe, and the shell waiting in the run's fresh cgroup."""
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self._scratch))
        group: RunCgroup | None = None
        status_r = status_w = filter_r = -1
        try:
            if self.memory_cgroups is not None:
                group = self.memory_cgroups.create(None)  # its limit is the run's, set then
            status_r, status_w = os.pipe()
            fds = [status_w]
            if self._seccomp is not None:
                filter_r, filter_w = os.pipe()
                os.write(filter_w, self._seccomp)  # a few hundred bytes: fits the pipe buffer
                os.close(filter_w)
                fds.append(filter_r)
            script, procs = (_JOIN_AND_WAIT, str(group.procs)) if group else (_WAIT, "-")
            with open(run_dir / "stdout", "wb") as out, open(run_dir / "stderr", "wb") as err:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", script, procs, str(run_dir / "command")],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    env={},
                    pass_fds=fds,
                    start_new_session=True,
                )
        except BaseException:
            if status_r >= 0:
                os.close(status_r)
            if group is not None:
                group.finish()
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        finally:
            for fd in (status_w, filter_r):
                if fd >= 0:
                    os.close(fd)
        return _Ready(proc, group, run_dir, status_r, status_w, filter_r if filter_r >= 0 else None)

    def _run(self, ready, uid, argv, limits, mounts, stdin, cwd, env, writable_dirs) -> RunResult:  # noqa: ANN001
        for d in writable_dirs:
            _chown_tree(d, uid)
        try:
            return self._spawn(ready, uid, argv, limits, mounts, stdin, cwd, env)
        finally:
            for d in writable_dirs:
                _chown_tree(d, 0)
            shutil.rmtree(ready.run_dir, ignore_errors=True)

    def _spawn(self, ready, uid, argv, limits, mounts, stdin, cwd, env) -> RunResult:  # noqa: ANN001
        group = ready.group
        if group is not None:
            try:
                group.limit(limits.memory_bytes + SANDBOX_OVERHEAD_BYTES)
            except OSError:
                ready.discard()
                raise
        try:
            result = self._spawn_in(ready, uid, argv, limits, mounts, stdin, cwd, env)
        finally:
            usage = group.finish() if group is not None else None
        if usage is None:  # judged by the peak RSS
            over = result.max_rss_bytes > limits.memory_bytes
        else:  # killed at the limit: by the OOM killer, or SIGKILLed while charges met it
            over = usage.oom_kills > 0 or (usage.limit_hits > 0 and result.signal == signal.SIGKILL)
        return dataclasses.replace(result, over_memory=over)

    def _spawn_in(self, ready, uid, argv, limits, mounts, stdin, cwd, env) -> RunResult:  # noqa: ANN001
        disk = str(limits.disk_bytes)
        args = [self._bwrap, *self._fixed_args]
        args += ["--size", disk, "--perms", "1777", "--tmpfs", "/tmp"]
        args += ["--size", disk, "--perms", "1777", "--tmpfs", "/work"]
        args += self._mount_args(mounts, created={"/", "/etc", "/tmp", "/work"})
        for k, v in {**DEFAULT_ENV, **(env or {})}.items():
            args += ["--setenv", k, v]
        if ready.filter_fd is not None:
            args += ["--seccomp", str(ready.filter_fd)]
        cpu_s = int(limits.cpu_time_s) + 1  # the verdict compares the measured time to the limit
        factor = CGROUP_ADDRESS_SPACE_FACTOR if ready.group else RSS_ADDRESS_SPACE_FACTOR
        address_space = max(limits.address_space_bytes, limits.memory_bytes * factor)
        args += [
            _LAUNCHER_IN_SANDBOX,
            "--status-fd",
            str(ready.status_fd),
            "--uid",
            str(uid),
            "--gid",
            str(uid),
            "--wall-ms",
            str(int(limits.wall_time_s * 1000)),
            "--cpu-s",
            str(cpu_s),
            "--as",
            str(address_space),
            "--fsize",
            str(limits.output_bytes),
            "--nofile",
            str(limits.open_files),
            "--nproc",
            str(limits.processes),
            "--stack",
            _stack_arg(limits),
            "--cwd",
            cwd,
        ]
        if stdin is not None:
            args += ["--stdin", stdin]
        args += ["--", *argv]
        # The waiting shell (in the run's cgroup: so is every process it starts) becomes bwrap.
        (ready.run_dir / "command").write_text(f"exec {shlex.join(args)} </dev/null\n")
        proc = ready.proc
        try:
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the shell is gone (it could not join its cgroup): no status line, said below
        out_path, err_path = ready.run_dir / "stdout", ready.run_dir / "stderr"
        backstop = limits.wall_time_s + 10.0  # the launcher enforces the real wall limit
        try:
            with os.fdopen(ready.status_r, "r") as status_file:
                proc.wait(timeout=backstop)
                status_line = status_file.read(4096)
        except subprocess.TimeoutExpired:
            proc.kill()  # the sandbox's pid 1 dies with bwrap and takes the namespace along
            proc.wait()
            status_line = ""
        stdout = _read_capped(out_path, limits.output_bytes)
        stderr = _read_tail(err_path, _STDERR_KEPT)
        if not status_line.strip():
            return RunResult(
                exit_code=None,
                signal=0,
                cpu_time_s=0.0,
                wall_time_s=0.0,
                max_rss_bytes=0,
                timed_out=False,
                stdout=b"",
                stderr=stderr,
                error=f"sandbox failed (bwrap exit {proc.returncode}): "
                f"{stderr.decode(errors='replace').strip()[-300:]}",
            )
        st = _parse_status(status_line)
        error = ""
        if st["exec_errno"]:
            error = f"could not start {argv[0]}: {os.strerror(st['exec_errno'])}"
        return RunResult(
            exit_code=st["code"] if st["exited"] else None,
            signal=st["signal"],
            cpu_time_s=st["cpu_ms"] / 1000,
            wall_time_s=st["wall_ms"] / 1000,
            max_rss_bytes=st["maxrss_kb"] * 1024,
            timed_out=bool(st["timed_out"]),
            stdout=stdout,
            stderr=stderr,
            error=error,
        )


def _read_capped(path: Path, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap)


def _read_tail(path: Path, keep: int) -> bytes:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - keep))
        return f.read(keep)


def _chown_tree(root: Path, uid: int) -> None:
    """Hands a directory tree to ``uid`` (0: back to root). Never follows symlinks."""
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
