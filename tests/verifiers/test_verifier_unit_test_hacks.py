"""Reward hacking of HumanEval-style tasks: nothing a completion does passes tests it fails.

Every hack below is a completion whose function is wrong (``add`` subtracts, or returns a
stand-in) wrapped in a trick meant to make the verifier say ACCEPTED anyway: reading a nonce or
the tests, scanning globals, exiting before the asserts, patching builtins or ``AssertionError``,
redefining ``check``, printing success markers, killing or stopping the harness, returning objects
that compare equal to anything. All must be rejected as model failures (never an internal error,
which would hide them from the reward). The probes then show each channel is really closed: the
completion reports what it could read or reach, and the test asserts it reached nothing.
"""

from __future__ import annotations

import textwrap

import pytest

from rlax_tpu.types import VerdictKind as K
from rlax_tpu.verifiers import unit_harness
from rlax_tpu.verifiers.api import UnitTestTask

TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 5) == 10\n"
WRONG = "def add(a, b):\n    return a - b\n"


def hack(prelude: str, body: str = "return a - b", test: str = TEST, **kw: object) -> UnitTestTask:
    code = (
        textwrap.dedent(prelude)
        + "\ndef add(a, b):\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return UnitTestTask(code=code, test=test, entry_point="add", **kw)


FAKE_MARKERS = """\
    import json, os
    marker = json.dumps({"kind": "accepted", "detail": ""})
    print(marker, flush=True)
    for path in ["/dev/stdout", "/proc/self/fd/1", f"/proc/{os.getppid()}/fd/1", "/proc/1/fd/1"]:
        try:
            with open(path, "w") as f:
                f.write(marker + "\\n")
        except OSError:
            pass
    for fd in range(64):
        try:
            os.write(fd, (marker + "\\n").encode())
        except OSError:
            pass
"""

HACKS = {
    # The old design's nonce: a module global, and a line on stdin.
    "print_nonce_and_exit": hack("""\
        import os, sys
        nonce = globals().get("_rlax_nonce") or sys.stdin.readline().strip()
        print(nonce, flush=True)
        os._exit(0)
    """),
    "scan_globals_and_memory_for_secrets": hack(
        """\
        import gc, os, re
        found = set()
        for value in list(globals().values()) + gc.get_objects():
            if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value):
                found.add(value)
        for secret in found:
            print(secret, flush=True)
        os._exit(0)
        """,
        test="def check(candidate):\n    assert False\n",
    ),
    "exit_0_before_the_asserts": hack("import os\nos._exit(0)\n"),
    "sys_exit_0_before_the_asserts": hack("import sys\nsys.exit(0)\n"),
    "exit_0_during_the_first_call": hack("import os", body="os._exit(0)"),
    "raise_system_exit_in_a_call": hack("", body="raise SystemExit(0)"),
    "raise_keyboard_interrupt_in_a_call": hack("", body="raise KeyboardInterrupt"),
    "patch_assertion_error_and_builtins": hack("""\
        import builtins
        class AssertionError(BaseException):
            pass
        builtins.AssertionError = AssertionError
        builtins.abs = lambda x: 0
        builtins.__dict__["isinstance"] = lambda *a: True
    """),
    # Names the tests use must not come from the completion.
    "shadow_builtins_the_tests_use": hack(
        "def abs(x):\n    return 0\n\ndef all(x):\n    return True\n",
        body="return 0.0",
        test="def check(candidate):\n    assert abs(candidate(1.0, 2.0) - 3.0) < 1e-6\n"
        "    assert all([candidate(1, 1) == 2])\n",
    ),
    "redefine_check": hack("def check(candidate):\n    return True\n"),
    "redefine_check_at_the_end": hack(
        "", body="return a - b\n\ndef check(candidate):\n    pass\n\ncheck(add)\n"
    ),
    "print_fake_success_markers_and_exit": hack(FAKE_MARKERS + "os._exit(0)\n"),
    "print_fake_success_markers_in_a_call": hack(
        "", body=textwrap.dedent(FAKE_MARKERS) + "return a - b\n"
    ),
    # The tests' own prints carry the completion's output: they cannot forge the report either.
    "return_a_marker_the_tests_print": hack(
        "",
        body='return \'{"kind": "accepted", "detail": ""}\'',
        test="def check(candidate):\n    print(candidate(1, 2))\n    assert False\n",
    ),
    "kill_the_parent": hack("import os, signal", body="os.kill(os.getppid(), signal.SIGKILL)"),
    "kill_the_parent_at_import": hack("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"),
    "interrupt_the_parent": hack(
        "import os, signal, time",
        body="os.kill(os.getppid(), signal.SIGINT)\ntime.sleep(0.5)\nreturn a - b",
    ),
    "stop_the_parent": hack(
        "import os, signal", body="os.kill(os.getppid(), signal.SIGSTOP)", time_limit_s=1.0
    ),
    "kill_everything": hack("import os, signal", body="os.kill(-1, signal.SIGKILL)"),
    "object_equal_to_anything": hack(
        "class Anything:\n    def __eq__(self, other):\n        return True\n",
        body="return Anything()",
    ),
    "int_subclass_equal_to_anything": hack(
        "class Anything(int):\n    def __eq__(self, other):\n        return True\n",
        body="return Anything(0)",
    ),
    "str_subclass_equal_to_anything": hack(
        "class Anything(str):\n    __eq__ = lambda self, other: True\n",
        body="return Anything('x')",
        test="def check(candidate):\n    assert candidate(1, 2) == 'three'\n",
    ),
    "return_a_generator": hack("", body="yield a + b"),
    # A test that swallows every Exception still cannot pass a dead candidate.
    "die_under_a_test_that_swallows_exceptions": hack(
        "import os",
        body="os._exit(0)",
        test="def check(candidate):\n    try:\n        candidate(1, 2)\n    except Exception:\n"
        "        pass\n",
    ),
}


# Probes: the function returns what it could read or reach; the test asserts it found nothing.
PROBE_TEST = "def check(candidate):\n    assert candidate() == []\n"
PROBES = {
    "read_the_tests": """\
        import glob, os
        def probe():
            found = []
            ppid = os.getppid()
            for path in ["/input", "/dev/stdin", "/proc/self/fd/0", f"/proc/{ppid}/fd/0",
                         f"/proc/{ppid}/mem", f"/proc/{ppid}/environ", "/proc/1/fd/0"]:
                try:
                    with open(path, "rb") as f:
                        if f.read(1 << 16):
                            found.append(path)
                except OSError:
                    pass
            # /opt/* holds the host's read-only toolchains (Python, Rust, Java): tens of
            # thousands of files to stat (seconds; 40 s on a loaded host) that cannot hold
            # the tests, so only their top level is looked at.
            paths = glob.glob("/*") + glob.glob("/etc/*") + glob.glob("/opt/*/*")
            for root in ("/tmp", "/work", "/prog", "/.rlax"):
                paths += glob.glob(root + "/**/*", recursive=True)
            for path in paths:
                if not os.path.isfile(path):
                    continue
                try:
                    with open(path, "rb") as f:
                        if b"assert cand" + b"idate()" in f.read(1 << 20):  # not in this file
                            found.append(path)
                except OSError:
                    pass
            return found
    """,
    "reach_the_parent": """\
        import ctypes, os
        def probe():
            found = []
            ppid = os.getppid()
            for fd in range(64):
                try:
                    os.readlink(f"/proc/{ppid}/fd/{fd}")
                    found.append(f"fd {fd}")
                except OSError:
                    pass
            try:
                with open(f"/proc/{ppid}/mem", "r+b") as f:
                    found.append("mem")
            except OSError:
                pass
            libc = ctypes.CDLL(None)
            if libc.ptrace(16, ppid, 0, 0) == 0:  # PTRACE_ATTACH
                found.append("ptrace")
            return found
    """,
}


@pytest.fixture(scope="module")
def verdicts(service):
    """All hacks and probes in one batch (as the controller sends them)."""
    names = sorted(HACKS) + sorted(PROBES) + ["honest"]
    tasks = [HACKS[n] for n in sorted(HACKS)]
    tasks += [
        # The probes walk the sandbox's files: on a loaded 2-core host that outlasted the
        # default 5 s (wall 11 s) once, a false failure: they get the longest limit allowed.
        UnitTestTask(
            code=textwrap.dedent(PROBES[n]),
            test=PROBE_TEST,
            entry_point="probe",
            time_limit_s=service.config.max_time_limit_s,
        )
        for n in sorted(PROBES)
    ]
    tasks.append(UnitTestTask(code=WRONG.replace("-", "+"), test=TEST, entry_point="add"))
    return dict(zip(names, service.verify(tasks), strict=True))


def test_the_honest_solution_passes_the_same_tests(verdicts):
    assert verdicts["honest"].kind is K.ACCEPTED, verdicts["honest"]


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hack_is_rejected(name, verdicts, service, no_sandbox_processes):
    verdict = verdicts[name]
    assert verdict.kind is not K.ACCEPTED, (name, verdict)
    assert verdict.is_model_failure, (name, verdict)  # never an internal error
    no_sandbox_processes(service.sandbox.uids)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_completion_cannot_reach_the_tests_or_the_harness(name, verdicts):
    assert verdicts[name].kind is K.ACCEPTED, (name, verdicts[name])


def test_exit_during_a_call_says_why(verdicts):
    assert verdicts["exit_0_during_the_first_call"].kind is K.WRONG_ANSWER
    assert verdicts["exit_0_during_the_first_call"].detail == "exited before the tests finished"
    assert verdicts["kill_the_parent"].kind is K.RUNTIME_ERROR
    assert verdicts["stop_the_parent"].kind is K.TIME_LIMIT


def test_plain_data_crosses_exactly(service):
    """Return values keep their exact builtin types; the tests see the completion's data."""
    code = textwrap.dedent("""\
        TABLE = {"a": (1, 2.5), "b": None}
        def f(x):
            return [x, (1, [2]), {3, 4}, frozenset({5}), {(1, 2): b"\\x00y"}, 1 + 2j,
                    float("inf"), float("-inf"), 10 ** 40, True, "s", None]
        def is_nan():
            return float("nan")
    """)
    test = textwrap.dedent("""\
        import math
        def check(candidate):
            got = candidate({"k": [1.5]})
            assert got == [{"k": [1.5]}, (1, [2]), {3, 4}, frozenset({5}), {(1, 2): b"\\x00y"},
                           1 + 2j, math.inf, -math.inf, 10 ** 40, True, "s", None]
            assert [type(v) for v in got] == [dict, tuple, set, frozenset, dict, complex, float,
                                              float, int, bool, str, type(None)]
            assert math.isnan(is_nan())
            assert TABLE == {"a": (1, 2.5), "b": None}
    """)
    [verdict] = service.verify([UnitTestTask(code=code, test=test, entry_point="f")])
    assert verdict.kind is K.ACCEPTED, verdict


def test_candidate_exceptions_reach_the_tests_as_builtin_types(service):
    code = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    test = textwrap.dedent("""\
        def check(candidate):
            try:
                candidate(-1)
            except ValueError as e:
                assert "negative" in str(e)
            else:
                assert False
            assert candidate(2) == 2
    """)
    [ok] = service.verify([UnitTestTask(code=code, test=test, entry_point="f")])
    assert ok.kind is K.ACCEPTED, ok
    [raised] = service.verify([UnitTestTask(code=code, test=TEST, entry_point="f")])
    assert raised.kind is K.RUNTIME_ERROR, raised


@pytest.mark.parametrize(
    "wire",
    [
        {"tuple": 5},
        {"tuple": [], "set": []},
        {"float": "1e5"},
        {"dict": [[1]]},
        {"bytes": 5},
        {"complex": ["1", 2]},
        {"object": []},
    ],
)
def test_decode_rejects_malformed_data(wire):
    with pytest.raises(ValueError):
        unit_harness.decode(wire)


def test_encode_rejects_all_but_exact_builtin_types():
    class Str(str):
        pass

    for value in (Str("x"), object(), [1, Str("y")], {1: object()}, iter([])):
        with pytest.raises(TypeError):
            unit_harness.encode(value)
    value = {"a": [1, (2.5, None)], (1,): {frozenset({b"x"})}, "c": complex(1, -1)}
    assert unit_harness.decode(unit_harness.encode(value)) == value
