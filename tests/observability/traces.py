"""Reads back a process's jax.profiler trace (observability/profiles.py)."""

from __future__ import annotations

from pathlib import Path

PJIT = "PjitFunction("


def traced_programs(process_dir: Path) -> set[str]:
    """The jitted functions a process's trace saw called: JAX names each call's event
    ``PjitFunction(<name>)``."""
    from jax.profiler import ProfileData

    (xplane,) = process_dir.glob("plugins/profile/*/*.xplane.pb")
    names = set()
    for plane in ProfileData.from_file(str(xplane)).planes:
        for line in plane.lines:
            names |= {e.name[len(PJIT) : -1] for e in line.events if e.name.startswith(PJIT)}
    return names
