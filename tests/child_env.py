"""The environment of a process a test starts: JAX on the CPU with ``devices`` host devices and
the suite's compile shortcuts (FAST_COMPILE, as tests/conftest.py sets for this process). A
child started without them compiles every program at -O2: twice the CPU of a cold controller
run here (38 s against 19 s)."""

from __future__ import annotations

import os

# LLVM's optimizations off, and XLA:CPU's older loop emitters instead of its fusion emitters:
# the new emitters took half as much CPU again to compile the suite's small programs (two
# sample module pairs: 62 -> 43 s and 87 -> 59 s of CPU), which it mostly runs a few times.
# And one LLVM module a program, not split for parallel code generation: the split costs more
# CPU than it saves time on 2 shared cores (six compiles of a 4-layer model's gradient, three
# runs each, alternating: 4.2-5.1 s of CPU split, 2.6-4.0 s not); the same code either way.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)


def xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a process with ``devices`` CPU devices (1: JAX's default)."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices > 1 else ""
    return count + FAST_COMPILE


def child_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """os.environ for a child with ``devices`` CPU devices, plus ``extra``."""
    return os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices)} | extra
