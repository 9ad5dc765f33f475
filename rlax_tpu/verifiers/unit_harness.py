"""The trusted harness of HumanEval-style problems; runs *inside* the sandbox (stdlib only).

The test code (``check(candidate)``) is trusted, the completion is not, so they run in separate
processes and nothing the completion does can make the tests pass without passing them:

* The harness process gets the test code on stdin, which the launcher opens as root from a file
  only root can read: the completion cannot open it (and so cannot read the expected answers).
* Before it starts the completion, the harness makes itself non-dumpable: its ``/proc/<pid>/``
  fds and memory (and ptrace, which seccomp denies anyway) are then out of reach of the
  completion's process even though both run as the same uid.
* The completion runs in a child process, forked before the tests are read, whose stdin,
  stdout and stderr are ``/dev/null``; it speaks only through two pipes. Each function the completion defines becomes a
  proxy in the harness: a call sends its arguments to the child as plain data (JSON with tags for
  tuples, sets, dicts, bytes and complex numbers) and gets plain data back, built from exact
  builtin types only. An object whose ``__eq__`` always says yes cannot cross.
* ``check`` runs in the harness, so its asserts run there: exiting early, ``os._exit(0)``, patching
  ``builtins`` or ``AssertionError``, redefining ``check`` or printing anything happen in the
  child and change nothing. The harness reports one JSON line on a private copy of its stdout
  (fd 1 itself is pointed at stderr first, so the tests' own prints cannot forge it):
  ``{"kind": "accepted"}`` or ``{"kind": ..., "detail": ...}``. Killing the harness leaves no
  line and a signal exit, which is never a pass.
* A failed assert is reported as its line of the tests and, for ``assert x == y``, the value of
  x (the asserts are rewritten to record it as they run, so nothing is called twice): the
  feedback a model repairing its program reads.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
import signal
import sys
import types

TEST_FILENAME = "<rlax-test>"
MAX_LINE = 64 << 20  # bytes of one message between harness and child
MAX_NAMES = 4096
MAX_GLOBAL_BYTES = 1 << 20  # larger data globals are not shared with the tests
_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3
SEEN = "__rlax_seen__"  # the tests' asserts of == report their left side through this name
MAX_DETAIL = 600


# -- plain data ------------------------------------------------------------------------------


def encode(x: object) -> object:
    """A JSON-able form of ``x``; only exact builtin data types are allowed (no subclasses)."""
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return x if math.isfinite(x) else {"float": repr(x)}
    if t is list:
        return [encode(v) for v in x]
    if t is tuple:
        return {"tuple": [encode(v) for v in x]}
    if t is set or t is frozenset:
        return {t.__name__: [encode(v) for v in x]}
    if t is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in x.items()]}
    if t is bytes:
        return {"bytes": x.hex()}
    if t is complex:
        return {"complex": [encode(x.real), encode(x.imag)]}
    raise TypeError(
        f"a {t.__name__} is not plain data (only None, bool, int, float, str, "
        "bytes, complex, list, tuple, dict, set and frozenset can be returned)"
    )


_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def decode(x: object) -> object:
    """The inverse of :func:`encode` for data from an untrusted peer: builds builtin types only."""
    t = type(x)
    if x is None or t is bool or t is int or t is str or t is float:
        return x
    if t is list:
        return [decode(v) for v in x]
    if t is dict and len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "float" and v in _FLOATS:
            return _FLOATS[v]
        if type(v) is list:
            if tag == "tuple":
                return tuple(decode(i) for i in v)
            if tag == "set":
                return {decode(i) for i in v}
            if tag == "frozenset":
                return frozenset(decode(i) for i in v)
            if tag == "dict":
                return {decode(k): decode(val) for k, val in (_pair(p) for p in v)}
            if tag == "complex" and len(v) == 2 and all(type(p) in (int, float) for p in v):
                return complex(v[0], v[1])
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
    raise ValueError("malformed plain data from the candidate")


def _pair(p: object) -> tuple[object, object]:
    if type(p) is not list or len(p) != 2:
        raise ValueError("malformed plain data from the candidate")
    return p[0], p[1]


def _send(f, message: object) -> None:  # noqa: ANN001
    f.write(json.dumps(message, allow_nan=True, separators=(",", ":")).encode() + b"\n")
    f.flush()


def _receive(f) -> object:  # noqa: ANN001
    line = f.readline(MAX_LINE + 1)
    if not line.endswith(b"\n"):
        raise EOFError if not line else ValueError("message from the candidate is too long")
    return json.loads(line)


# -- the candidate's side ----------------------------------------------------------------------


def candidate_main(source_path: str, requests_fd: int, replies_fd: int) -> None:
    """Runs the completion as ``__main__``, then answers calls until the harness hangs up."""
    requests = os.fdopen(requests_fd, "rb")
    replies = os.fdopen(replies_fd, "wb")
    with open(source_path, "rb") as f:
        source = f.read()
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": source_path}
    try:
        exec(compile(source, source_path, "exec"), namespace)
    except SystemExit as e:
        code = e.code if e.code is None or type(e.code) is int else 1
        os._exit(code or 0)
    except BaseException as e:  # noqa: BLE001 - reported to the harness
        _send(replies, {"failed": type(e).__name__, "message": str(e)[:300]})
        os._exit(1)
    names, values = [], {}  # its functions (not classes or modules) and its plain data
    for name, value in list(namespace.items())[:MAX_NAMES]:
        if not (isinstance(name, str) and name.isidentifier()) or name.startswith("__"):
            continue
        if isinstance(value, (type, types.ModuleType)):
            continue
        if callable(value):
            if getattr(value, "__module__", None) != "typing":  # List, Optional...
                names.append(name)
            continue
        try:
            data = encode(value)
        except (TypeError, ValueError, RecursionError):
            continue
        if len(json.dumps(data)) <= MAX_GLOBAL_BYTES:
            values[name] = data
    _send(replies, {"names": names, "values": values})
    while True:
        try:
            name, args, kwargs = _receive(requests)
            result = namespace[name](*decode(args), **decode(kwargs))
            reply = {"value": encode(result)}
        except EOFError:
            os._exit(0)
        except Exception as e:  # noqa: BLE001
            reply = {"error": type(e).__name__, "message": str(e)[:300]}
        _send(replies, reply)


# -- the harness's side ------------------------------------------------------------------------


class CandidateDied(BaseException):
    """The completion's process ended (or broke the protocol) while a call was pending.

    Not an ``Exception``: a test's ``except Exception`` must not swallow it."""


class _Remote:
    """Stands in for one function of the completion: calls cross as plain data."""

    def __init__(self, name: str, channel: _Channel):
        self.__name__ = name
        self._channel = channel

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._channel.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<candidate function {self.__name__}>"


def _exception_type(name: object) -> type[Exception]:
    """The builtin exception the completion raised (ValueError...), else a RuntimeError."""
    found = getattr(builtins, name, None) if isinstance(name, str) else None
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return RuntimeError


class _Channel:
    def __init__(self, pid: int, requests, replies):  # noqa: ANN001
        self.pid, self._requests, self._replies = pid, requests, replies
        self.status: int | None = None  # wait status once the child is reaped
        self.dead = False  # the child is gone or broke the protocol: nothing it did counts
        self.killed = False  # the harness killed it (for breaking the protocol)

    def receive(self) -> object:
        if self.dead:
            raise CandidateDied("the candidate's process is gone")
        try:
            return _receive(self._replies)
        except EOFError:
            self.dead = True  # it exited (or closed its end): reap it
            raise CandidateDied("the candidate's process is gone") from None
        except (ValueError, UnicodeDecodeError, RecursionError):
            self.broke_protocol()

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        message = [name, encode(list(args)), encode(kwargs)]
        if self.dead:
            raise CandidateDied("the candidate's process is gone")
        try:
            _send(self._requests, message)
        except OSError:
            self.dead = True
            raise CandidateDied("the candidate's process is gone") from None
        reply = self.receive()
        if type(reply) is dict and "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, RecursionError):
                pass
        elif type(reply) is dict and "error" in reply:
            error = _exception_type(reply.get("error"))
            raise error(f"{reply.get('error')}: {reply.get('message')}"[:300])
        self.broke_protocol()

    def broke_protocol(self) -> None:  # always raises
        self.dead = self.killed = True
        os.kill(self.pid, signal.SIGKILL)
        raise CandidateDied("the candidate broke the call protocol")

    def reap(self) -> int:
        if self.status is None:
            self.status = os.waitpid(self.pid, 0)[1]
        return self.status


def _make_private() -> None:
    """Non-dumpable: /proc/<pid>/{fd,mem,environ} and ptrace become root-only."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError("could not make the test harness non-dumpable")


def _spawn_candidate(source_path: str) -> _Channel:
    """Forks the completion's process: before the tests are read, so its memory holds none."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # only its two pipe ends stay open, with /dev/null as stdio
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            keep = sorted((req_r, rep_w))
            os.closerange(3, keep[0])
            os.closerange(keep[0] + 1, keep[1])
            os.closerange(keep[1] + 1, 1 << 20)
            candidate_main(source_path, req_r, rep_w)
        finally:
            os._exit(1)
    os.close(req_r)
    os.close(rep_w)
    return _Channel(pid, os.fdopen(req_w, "wb"), os.fdopen(rep_r, "rb"))


def _death(channel: _Channel) -> tuple[str, str]:
    """Why the candidate is gone (killing it first if it broke the protocol)."""
    status = channel.reap()
    if channel.killed:
        return "runtime_error", "the candidate broke the call protocol"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return "time_limit", "the candidate ran out of CPU time"
        return "runtime_error", f"the candidate was killed by {signal.Signals(sig).name}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "wrong_answer", "exited before the tests finished"
    return "runtime_error", f"the candidate exited with code {code}"


class _Comparisons:
    """The left side of each ``assert a == b`` of the tests as they run (the tests are rewritten
    to pass it through ``seen``), so a failed one reports what the candidate gave without
    calling it twice."""

    def __init__(self) -> None:
        self.line, self.left = 0, None

    def seen(self, left: object, right: object, line: int) -> bool:
        self.line, self.left = line, left
        return left == right


class _RecordEquality(ast.NodeTransformer):
    def visit_Assert(self, node: ast.Assert) -> ast.Assert:  # noqa: N802 - the ast visitor name
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            call = ast.Call(
                func=ast.Name(id=SEEN, ctx=ast.Load()),
                args=[t.left, t.comparators[0], ast.Constant(node.lineno)],
                keywords=[],
            )
            node.test = ast.copy_location(call, t)
        return node


def _compile_test(test: str) -> types.CodeType:
    tree = ast.fix_missing_locations(_RecordEquality().visit(ast.parse(test, TEST_FILENAME)))
    return compile(tree, TEST_FILENAME, "exec")


def _failed_assert(error: AssertionError, test: str, seen: _Comparisons) -> str:
    """``failed: <the assert>`` (and ``got: <its left side>`` for ``==``), from the innermost
    line of the test code the error passed through."""
    line, tb = 0, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == TEST_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    asserts = [
        n for n in ast.walk(ast.parse(test)) if isinstance(n, ast.Assert) and n.lineno == line
    ]
    if not asserts:
        return "a test assertion failed"
    detail = f"failed: {ast.get_source_segment(test, asserts[0]) or ''}"[:MAX_DETAIL]
    if seen.line == line:
        detail += f"\ngot: {_short_repr(seen.left)}"
    return detail


def _short_repr(x: object) -> str:
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 - plain data from the candidate; never expected
        return "?"
    return text if len(text) <= MAX_DETAIL // 2 else text[: MAX_DETAIL // 2] + "..."


def _outcome(
    error: BaseException, channel: _Channel, test: str = "", seen: _Comparisons | None = None
) -> tuple[str, str]:
    if isinstance(error, CandidateDied):
        return _death(channel)
    if isinstance(error, AssertionError):
        return "wrong_answer", _failed_assert(error, test, seen or _Comparisons())
    if isinstance(error, MemoryError):
        return "memory_limit", "out of memory"
    return "runtime_error", f"{type(error).__name__}: {error}"[:300]


def _globals(hello: object, channel: _Channel) -> dict[str, object]:
    """The completion's functions (as proxies) and plain data, from its first message."""
    try:
        names, values = hello["names"], hello["values"]  # type: ignore[index]
        remotes: dict[str, object] = {}
        for name in names[:MAX_NAMES]:
            if name.isidentifier() and not name.startswith("__"):
                remotes[name] = _Remote(name, channel)
        for name, value in list(values.items())[:MAX_NAMES]:
            if name.isidentifier() and not name.startswith("__") and name not in remotes:
                remotes[name] = decode(value)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        channel.broke_protocol()
    return remotes


def harness_main(source_path: str) -> int:
    _make_private()
    result = os.fdopen(os.dup(1), "w")  # only the harness holds this: the verdict goes here
    os.dup2(2, 1)  # the tests' own prints go to stderr

    def report(kind: str, detail: str = "") -> int:
        result.write(json.dumps({"kind": kind, "detail": detail}) + "\n")
        result.flush()
        return 0

    channel = _spawn_candidate(source_path)  # first: the fork must not copy the tests
    spec = json.loads(sys.stdin.buffer.read())
    test, entry_point = spec["test"], spec["entry_point"]
    try:
        code = _compile_test(test)
    except SyntaxError as e:
        return report("internal_error", f"the test code does not compile: {e}")
    seen = _Comparisons()
    try:
        hello = channel.receive()
        if type(hello) is dict and "failed" in hello:
            kind = "memory_limit" if hello["failed"] == "MemoryError" else "runtime_error"
            return report(kind, f"{hello['failed']}: {hello.get('message')}"[:300])
        remotes = _globals(hello, channel)
    except CandidateDied:
        return report(*_death(channel))
    # The tests see the completion's functions and data, but never a name of a builtin (its
    # own `abs` or `AssertionError` must not reach them) nor `check`: the tests' names win.
    namespace: dict[str, object] = {
        "__name__": "__main__",
        "__builtins__": builtins,
        SEEN: seen.seen,
    }
    namespace.update(
        (n, r) for n, r in remotes.items() if n != "check" and not hasattr(builtins, n)
    )
    try:
        exec(code, namespace)
        if entry_point:
            check = namespace.get("check")
            ok = isinstance(check, types.FunctionType)
            if not ok or check.__code__.co_filename != TEST_FILENAME:
                return report("internal_error", "the test code defines no check()")
            candidate = namespace.get(entry_point, remotes.get(entry_point))
            if candidate is None:
                return report("wrong_answer", f"{entry_point} is not defined")
            check(candidate)
    except BaseException as e:  # noqa: BLE001 - whatever went wrong, the tests did not pass
        return report(*_outcome(e, channel, test, seen))
    if channel.dead:  # a test swallowed the error of a dead candidate
        return report(*_death(channel))
    return report("accepted")


if __name__ == "__main__":
    sys.exit(harness_main(sys.argv[1]))
