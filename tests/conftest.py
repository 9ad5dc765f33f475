"""Test-wide setup. XLA_FLAGS must be set before jax is imported anywhere, so it is set here."""

import os
import shutil
import sys
import tempfile

import pytest

from tests.child_env import FAST_COMPILE

# 8 CPU devices for the meshes; the compile shortcuts (tests/child_env.py): the suite spends
# most of its CPU compiling small programs it runs a few times (XLA's own passes still run, and
# every comparison is between programs built alike or within tolerances).
for _flag in ("--xla_force_host_platform_device_count=8", *FAST_COMPILE.split()):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole test run, its workers and every process they
# start (rlax_tpu.cli.use_compilation_cache honours it): most tests start the same small models'
# components, and a controller that loads its programs starts in a third of the time. Removed at
# the end of the run.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
JAX_CACHE = os.path.join(tempfile.gettempdir(), f"rlax-test-jax-cache-{_RUN}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", JAX_CACHE)
# Every program, also the tests' own in-process ones (JAX's defaults skip those compiled in
# under a second, most of them here): tests build the same tiny models over and over (-17% on
# a sample of three modules run cold).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201, ARG001 - pytest hook
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's controller, after every worker
        shutil.rmtree(JAX_CACHE, ignore_errors=True)


def free_port() -> int:
    """A port nothing listens on right now (for a server that must be told its port up front,
    such as jax.distributed's coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GCS_BUCKET = "rlax-test"


@pytest.fixture(scope="session")
def gcs_emulator():  # noqa: ANN201 - a fixture generator
    """A real GCS server on 127.0.0.1 (the gcp-storage-emulator package, in memory, as
    tests/gcs_server.py runs it) with the
    bucket GCS_BUCKET; yields its URL and points this process's gs:// clients at it (gcsfs and
    google-cloud-storage by STORAGE_EMULATOR_HOST, TensorStore by TENSORSTORE_GCS_HTTP_URL).
    Child processes get both variables from ``os.environ``."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = os.path.join(os.path.dirname(__file__), "gcs_server.py")
    proc = subprocess.Popen(
        [sys.executable, server, f"--port={port}", f"--bucket={GCS_BUCKET}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b/{GCS_BUCKET}", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the GCS emulator did not start") from None
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    os.environ["STORAGE_EMULATOR_HOST"] = url
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)


def pytest_collection_finish(session):  # noqa: ANN001, ANN201, ARG001 - pytest hook
    # Every module the tests import (jax, flax, torch, transformers: millions of objects that
    # live as long as the worker) out of the cyclic GC's scans: each full collection walked them.
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():  # noqa: ANN202 - a fixture generator
    """A module's compiled programs and arrays given back when it ends: a worker that kept them
    reached 4.9 GB in 7 minutes (2.3 GB with this), and three beside a SmolLM2 run went past 24 GB
    (the kernel's OOM killer ended that run). Set up first, so torn down after the module's own
    fixtures."""
    yield
    import contextlib
    import ctypes
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed pages unless asked
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# Each test's CPU seconds: its worker's and those of the processes it started and waited for
# (under -n 3 on 2 cores a test's wall time mostly measures the others beside it). A module's
# fixtures count in its first test. `make test` ends with the costliest; RLAX_TEST_CPU_LOG=<file>
# also writes every test's, with the XLA compiles and the seconds (wall) its own process spent
# making programs: tracing, lowering, compiling or loading from the cache (docs/tests.md).
# Above the budget a test says why in a "Cost:" note (its or its module's docstring).
CPU_BUDGET_S = float(os.environ.get("RLAX_TEST_CPU_BUDGET_S", "60"))
TOP_CPU = 10
_cpu_start: dict[str, tuple[float, int, float]] = {}  # node id -> _cpu_now(), compiles, jit s
_cpu_seen: list[tuple[float, str, bool, int]] = []  # (CPU s, node id, Cost: note, compiles)
# In this process: XLA compiles (the run's cache missed), seconds spent making programs
# (tracing, lowering, compiling or loading from the cache), counting?
_compiles: list = [0, 0.0, False]
_JIT_EVENTS = frozenset(
    f"/jax/core/compile/{e}_duration"
    for e in ("jaxpr_trace", "jaxpr_to_mlir_module", "backend_compile")
)


def _count_compiles() -> None:
    """Counts from the first call once JAX is imported: each program the run's compilation cache
    did not have is compiled and written to it (tests/conftest.py writes every one)."""
    if _compiles[2] or "jax" not in sys.modules:
        return
    from jax import monitoring

    def on_event(event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_misses":
            _compiles[0] += 1

    def on_duration(event: str, duration_secs: float, **_: object) -> None:
        if event in _JIT_EVENTS:
            _compiles[1] += duration_secs

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    _compiles[2] = True


_is_xdist_worker = [False]


def pytest_configure(config):  # noqa: ANN001, ANN201 - pytest hook
    # Not PYTEST_XDIST_WORKER: a pytest that a test starts inherits it.
    _is_xdist_worker[0] = hasattr(config, "workerinput")


def _cpu_now() -> float:
    return sum(os.times()[:4])


def _has_cost_note(item: pytest.Item) -> bool:
    owners = (getattr(item, "obj", None), getattr(item, "module", None))
    return any("Cost:" in (getattr(o, "__doc__", None) or "") for o in owners if o is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # noqa: ANN001, ANN201 - pytest hook
    _count_compiles()
    _cpu_start[item.nodeid] = (_cpu_now(), _compiles[0], _compiles[1])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201 - pytest hook
    report = yield
    if call.when == "teardown" and item.nodeid in _cpu_start:
        cpu, compiles, jit_s = _cpu_start.pop(item.nodeid)
        report.user_properties.append(("cpu_s", round(_cpu_now() - cpu, 2)))
        report.user_properties.append(("compiles", _compiles[0] - compiles))
        report.user_properties.append(("jit_s", round(_compiles[1] - jit_s, 2)))
        report.user_properties.append(("cost_note", _has_cost_note(item)))
    return report


def pytest_runtest_logreport(report):  # noqa: ANN001, ANN201 - pytest hook
    """In the run's controller (xdist's, or the only process): every test's CPU seconds."""
    props = dict(report.user_properties)
    if report.when != "teardown" or "cpu_s" not in props or _is_xdist_worker[0]:
        return
    compiles = props.get("compiles", 0)
    _cpu_seen.append((props["cpu_s"], report.nodeid, bool(props.get("cost_note")), compiles))
    path = os.environ.get("RLAX_TEST_CPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{props['cpu_s']:.2f}\t{report.nodeid}\t{compiles}\t{props['jit_s']:.2f}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ANN001, ANN201, ARG001
    if not _cpu_seen:
        return
    tr = terminalreporter
    total = sum(row[0] for row in _cpu_seen)
    compiles = sum(row[3] for row in _cpu_seen)
    tr.section(
        f"the {TOP_CPU} costliest tests by CPU seconds (of {total:.0f} s in all tests; "
        f"{compiles} XLA compiles in the test processes)"
    )
    for cpu, node, _, n in sorted(_cpu_seen, reverse=True)[:TOP_CPU]:
        tr.write_line(f"{cpu:8.1f} s {n:5d} compiles  {node}")
    over = [(c, n) for c, n, noted, _ in _cpu_seen if c > CPU_BUDGET_S and not noted]
    for cpu, node in sorted(over, reverse=True):
        tr.write_line(
            f"over the {CPU_BUDGET_S:.0f} CPU-s budget with no 'Cost:' note in its docstring: "
            f"{node} ({cpu:.0f} s)",
            yellow=True,
        )
