"""Turning a sandboxed run into a verdict, and limits from a problem's numbers."""

from __future__ import annotations

import signal

from rlax_tpu.config import VerifierConfig
from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers.api import limit
from rlax_tpu.verifiers.compiler import Executable
from rlax_tpu.verifiers.sandbox import UNLIMITED_STACK, Limits, RunResult, signal_name

# What runtimes print when an allocation fails under RLIMIT_AS.
_OUT_OF_MEMORY_MARKERS = (
    b"MemoryError",
    b"std::bad_alloc",
    b"java.lang.OutOfMemoryError",
    b"memory allocation of",
    b"Cannot allocate memory",
    b"out of memory",
)


def program_limits(
    executable: Executable,
    *,
    time_limit_s: float,
    memory_mb: int,
    output_bytes: int,
    disk_bytes: int,
) -> Limits:
    extra = executable.language.extra_address_space_mb
    return Limits(
        cpu_time_s=time_limit_s,
        # Sleeping or blocked programs use no CPU; the wall limit catches them.
        wall_time_s=time_limit_s * 2 + 1,
        memory_bytes=memory_mb << 20,
        address_space_bytes=(memory_mb + extra) << 20,  # at least what the runtime reserves
        output_bytes=output_bytes,
        disk_bytes=disk_bytes,
        stack_bytes=UNLIMITED_STACK,  # deep recursion up to the limit, and threads that start
        processes=executable.language.processes,
    )


def whole_program_limits(
    config: VerifierConfig, executable: Executable, time_limit_s: float, *, factor: float = 1.0
) -> Limits:
    """Limits of one run of a whole program (a unit-test suite, a tool call): the task's time
    limit (0: ``factor`` x verifiers.time_limit_s, never above factor x max_time_limit_s) and
    the service's memory, output and disk limits."""
    return program_limits(
        executable,
        time_limit_s=limit(
            time_limit_s, config.time_limit_s * factor, config.max_time_limit_s * factor
        ),
        memory_mb=config.memory_limit_mb,
        output_bytes=config.max_output_bytes,
        disk_bytes=config.disk_limit_mb << 20,
    )


def classify(result: RunResult, limits: Limits, memory_mb: int) -> tuple[VerdictKind, str] | None:
    """The failure verdict of a run, or None when it exited cleanly (its output is then checked)."""
    if result.error:
        return VerdictKind.INTERNAL_ERROR, result.error
    # Python and the JVM ignore SIGXFSZ: a write fails (EFBIG) or is silently dropped instead.
    full = len(result.stdout) >= limits.output_bytes or b"File too large" in result.stderr
    if result.signal == signal.SIGXFSZ or full:
        return VerdictKind.OUTPUT_LIMIT, f"output over {limits.output_bytes} bytes"
    if result.over_memory:  # killed for it, or (peak RSS) held more than it
        return VerdictKind.MEMORY_LIMIT, f"memory limit {memory_mb} MB"
    if result.timed_out:
        return VerdictKind.TIME_LIMIT, f"wall-clock limit {limits.wall_time_s:g} s"
    if result.cpu_time_s > limits.cpu_time_s or result.signal == signal.SIGXCPU:
        return VerdictKind.TIME_LIMIT, f"CPU time over {limits.cpu_time_s:g} s"
    if result.exit_code == 0:
        return None
    near_limit = result.max_rss_bytes >= 0.9 * (memory_mb << 20)
    if near_limit or any(m in result.stderr for m in _OUT_OF_MEMORY_MARKERS):
        return VerdictKind.MEMORY_LIMIT, f"memory limit {memory_mb} MB"
    if result.signal:
        return VerdictKind.RUNTIME_ERROR, f"killed by {signal_name(result.signal)}"
    tail = result.stderr.decode(errors="replace").strip().splitlines()
    last = tail[-1][:160] if tail else ""
    return VerdictKind.RUNTIME_ERROR, f"exit code {result.exit_code}" + (
        f": {last}" if last else ""
    )
