"""The environment of a process a test starts: JAX on the CPU with ``devices`` host devices and
the suite's compile shortcut (LLVM's optimizations off, as tests/conftest.py sets for this
process). A child started without it compiles every program at -O2: twice the CPU of a cold
controller run here (38 s against 19 s)."""

from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a process with ``devices`` CPU devices (1: JAX's default)."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices > 1 else ""
    return count + FAST_COMPILE


def child_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """os.environ for a child with ``devices`` CPU devices, plus ``extra``."""
    return os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices)} | extra
