"""Python's "compilation" (a syntax check) in a long-lived helper process, not one sandbox run each.

``compile()`` parses and compiles a program without running any of it, so it needs no sandbox;
starting one (bwrap, then an interpreter) costs ~17 ms per program, as much as running a short
program's first test; a check in a helper costs ~0.1 ms. Hostile input can still crash or exhaust
a parser, so the check runs in a separate process: as an unprivileged uid (when started as root)
with no new privileges, no environment, an address-space limit and a per-check deadline. A helper
that dies on a check is replaced and the check retried once; dying again, or overrunning the
deadline, is a compile error. A helper that cannot start is an infrastructure error
(:class:`CheckerUnavailable`), never a verdict on the program. ``verifiers.python_check`` picks
this ("helper", the default) or a sandbox run per program ("sandbox").
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

# The helper's loop: read a length-prefixed (filename, source) pair, answer one JSON line.
_LOOP = r"""
import ctypes, json, os, resource, struct, sys, traceback
uid, mem = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
src_in, out = sys.stdin.buffer, sys.stdout
out.write('{"ready": true}\n')
out.flush()
def read(n):
    data = src_in.read(n)
    if len(data) != n:
        raise SystemExit(0)
    return data
while True:
    name_len, src_len = struct.unpack("<II", read(8))
    name, source = read(name_len).decode(), read(src_len)
    try:
        compile(source, name, "exec", dont_inherit=True)
        reply = {"ok": True}
    except BaseException as e:
        error = "".join(traceback.format_exception_only(type(e), e))
        reply = {"ok": False, "error": error[:4096]}
    out.write(json.dumps(reply) + "\n")
    out.flush()
"""


class CheckerUnavailable(RuntimeError):
    """The helper process could not be started (an infrastructure problem, not the source's)."""


class PythonSyntaxChecker:
    """Checks Python sources with ``compile()`` in a helper process (thread-safe; one at a time).

    ``uid``: the unprivileged uid the helper drops to when started as root. ``memory_bytes``: its
    address-space limit. ``timeout_s``: the deadline of one check. ``start_timeout_s``: the
    deadline of the helper's start-up, apart because booting an interpreter is not the source's
    time and a loaded host can take far longer than one check's deadline to do it.
    """

    def __init__(
        self, *, uid: int, memory_bytes: int, timeout_s: float, start_timeout_s: float = 30.0
    ):
        if uid <= 0:
            raise ValueError(f"uid must be > 0, got {uid}")
        self._uid, self._memory, self._timeout = uid, memory_bytes, timeout_s
        self._start_timeout = start_timeout_s
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        self._exe = str(Path(sys.base_prefix) / "bin" / version)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self.started = 0  # helpers started so far (a restart follows each crash or overrun)

    def check(self, source: bytes, filename: str) -> str | None:
        """None if ``source`` compiles; otherwise the error as Python reports it.

        A helper that dies on a check is replaced and the check retried once (it may have been
        killed from outside); dying twice, or overrunning the deadline, is the source's fault.
        """
        name = filename.encode()
        with self._lock:
            for _ in range(2):
                proc = self._ensure()
                try:
                    proc.stdin.write(struct.pack("<II", len(name), len(source)) + name + source)
                    proc.stdin.flush()
                    line = self._read_line(proc, time.monotonic() + self._timeout)
                except BrokenPipeError:
                    line = b""
                if line:
                    reply = json.loads(line)
                    return None if reply["ok"] else reply["error"]
                failure = self._fail(proc, overran=line is None)
                if line is None:
                    break
            return failure

    @property
    def pid(self) -> int | None:
        """The running helper's pid (None before the first check)."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
                self._proc = None

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [self._exe, "-I", "-S", "-c", _LOOP, str(self._uid), str(self._memory)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={},
                cwd="/",
                start_new_session=True,
            )
            self._buffer = b""
            self.started += 1
            ready = self._read_line(self._proc, time.monotonic() + self._start_timeout)
            if ready != b'{"ready": true}':
                self._kill(self._proc)
                code, self._proc = self._proc.returncode, None
                raise CheckerUnavailable(
                    f"the Python syntax-check helper did not start (exit status {code}); "
                    "set verifiers.python_check='sandbox' to check in the sandbox instead"
                )
        return self._proc

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> bytes | None:
        """The next reply line; b"" if the helper died, None past the deadline."""
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _fail(self, proc: subprocess.Popen, *, overran: bool) -> str:
        self._kill(proc)
        self._proc = None
        if overran:
            return f"the syntax check exceeded {self._timeout:g} s"
        code = proc.returncode
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return f"the syntax check died ({how}); the source is too large or too deeply nested"

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
