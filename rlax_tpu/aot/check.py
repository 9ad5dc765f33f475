"""Compile abstract programs for a TPU topology and measure them against its chips.

Per program and device: the compiled executable's argument, output, aliased (donated) and
temporary bytes (``memory_analysis``); its footprint = arguments + outputs - aliased +
temporaries; the peak = footprint + what the component keeps allocated beside the program
(``AbstractProgram.held``: resident state and the transients of that moment), as a fraction of
the HBM the compiler allows. A program fits when its peak leaves HEADROOM of that HBM free; the
compiled FLOPs and bytes accessed (``cost_analysis``) and a roofline time (the slower of FLOPs at
the chip's bf16 peak and bytes at its HBM bandwidth). Custom kernels (Pallas) are counted only
as far as they declare a cost, so attention-heavy programs' FLOPs are a lower bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from rlax_tpu.aot.chips import DeviceSpec, hbm_limit_from_error
from rlax_tpu.models.aot import AbstractProgram

FITS, TOO_BIG, FAILED = "fits", "does not fit", "does not compile"
# Kept free of the usable HBM: the compiler's analysis does not see allocator fragmentation, the
# runtime's own buffers (collectives, host transfers) or arrays the Python side briefly keeps.
HEADROOM = 0.05


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    name: str
    component: str
    topology: str
    status: str  # FITS, TOO_BIG or FAILED
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    resident_bytes: int = 0
    held: dict[str, int] = dataclasses.field(default_factory=dict)  # resident_bytes by name
    hbm_bytes: int = 0  # the usable HBM per device
    flops: float = 0.0
    bytes_accessed: float = 0.0
    roofline_s: float = 0.0
    compile_s: float = 0.0
    note: str = ""
    error: str = ""  # why it failed, or the compiler's out-of-memory message

    @property
    def footprint_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def peak_bytes(self) -> int:
        return self.footprint_bytes + self.resident_bytes

    @property
    def limit_bytes(self) -> int:
        """The most a program may peak at: the usable HBM less HEADROOM."""
        return int(self.hbm_bytes * (1 - HEADROOM))

    @property
    def hbm_fraction(self) -> float:
        return self.peak_bytes / self.hbm_bytes if self.hbm_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            footprint_bytes=self.footprint_bytes,
            peak_bytes=self.peak_bytes,
            hbm_fraction=self.hbm_fraction,
            limit_bytes=self.limit_bytes,
            headroom=HEADROOM,
        )
        return out


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    for ln in lines:  # XLA puts the reason after a status code on some line
        if any(
            k in ln
            for k in (
                "RESOURCE_EXHAUSTED",
                "INVALID_ARGUMENT",
                "UNIMPLEMENTED",
                "INTERNAL",
                "Error",
                "error",
            )
        ):
            return ln[:400]
    return (lines[0] if lines else "unknown error")[:400]


def compile_program(
    program: AbstractProgram,
    *,
    component: str,
    topology: str,
    device: DeviceSpec,
) -> ProgramReport:
    """Lowers and compiles one program for the topology and measures it (never raises for a
    program that does not compile or fit: the report says so)."""
    base = dict(
        name=program.name, component=component, topology=topology, hbm_bytes=device.usable_hbm_bytes
    )
    base.update(note=program.note, resident_bytes=program.resident_bytes, held=dict(program.held))
    start = time.perf_counter()
    mesh = jax.set_mesh(program.mesh) if program.mesh is not None else contextlib.nullcontext()
    try:
        with mesh:
            compiled = program.fn.lower(*program.args, **program.kwargs).compile()
    except Exception as e:  # noqa: BLE001 - reported by name, the run goes on
        message = str(e)
        elapsed = time.perf_counter() - start
        if "RESOURCE_EXHAUSTED" in message or hbm_limit_from_error(message) is not None:
            return ProgramReport(
                status=TOO_BIG, error=_first_line(message), compile_s=elapsed, **base
            )
        return ProgramReport(
            status=FAILED,
            error=f"{type(e).__name__}: {_first_line(message)}",
            compile_s=elapsed,
            **base,
        )
    elapsed = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    flops = float(cost.get("flops", 0.0))
    traffic = float(cost.get("bytes accessed", 0.0))
    report = ProgramReport(
        status=FITS,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        flops=flops,
        bytes_accessed=traffic,
        roofline_s=device.roofline_s(flops, traffic),
        compile_s=elapsed,
        **base,
    )
    if report.peak_bytes > report.limit_bytes:
        report = dataclasses.replace(report, status=TOO_BIG)
    return report


def compile_all(
    programs: list[AbstractProgram],
    *,
    component: str,
    topology: str,
    device: DeviceSpec,
    progress: Callable[[str], None] = lambda _: None,
) -> list[ProgramReport]:
    reports = []
    for program in programs:
        progress(f"compiling {program.name} for {topology} ...")
        report = compile_program(program, component=component, topology=topology, device=device)
        progress(f"  {program.name}: {report.status} ({report.compile_s:.1f} s)")
        reports.append(report)
    return reports
