"""The check itself: topology -> device specs, components -> abstract programs -> compiled
reports -> a table, a JSON file and an exit code (see ``__main__``)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from rlax_tpu import cli
from rlax_tpu.aot.check import FAILED, FITS, HEADROOM, TOO_BIG, ProgramReport, compile_all
from rlax_tpu.aot.chips import DeviceSpec, chip_of, device_spec
from rlax_tpu.config import RunConfig, libtpu
from rlax_tpu.config.slices import parse_slice
from rlax_tpu.models.aot import AbstractProgram

Builder = Callable[[RunConfig, Sequence[jax.Device]], list[AbstractProgram]]


class TopologyError(ValueError):
    """A topology name libtpu does not know, or libtpu is missing."""


def topology_devices(name: str, slices: int = 1) -> list[jax.Device]:
    """The devices of a TPU topology such as ``v5p:4x8x8`` (compile-only; needs libtpu), of
    ``slices`` such slices joined over DCN (each device knows its ``slice_index``)."""
    from jax.experimental import topologies

    try:
        chip_of(name)
    except KeyError as e:
        raise TopologyError(str(e.args[0])) from None
    try:
        parse_slice(name)  # a shape no node pool carries compiles, but could never run
    except ValueError as e:
        raise TopologyError(str(e)) from None
    try:
        extra = {"num_slices": slices} if slices > 1 else {}
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu", **extra)
        return list(desc.devices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors vary; say what to do
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "tpu" in text.lower() and ("plugin" in text.lower() or "backend" in text.lower()):
            text += " (is libtpu installed? pip install -e '.[tpu]')"
        raise TopologyError(f"topology {name!r}: {text}") from None


def _builders(component: str) -> dict[str, Builder]:
    from rlax_tpu.inference.aot import abstract_programs as inference_programs
    from rlax_tpu.trainer.aot import abstract_programs as trainer_programs

    every = {"trainer": trainer_programs, "inference": inference_programs}
    return every if component == "all" else {component: every[component]}


def cost_by_depth(
    config: RunConfig,
    build: Builder,
    devices: Sequence[jax.Device],
    reports: list[ProgramReport],
    *,
    component: str,
    topology: str,
    device: DeviceSpec,
    progress: Callable[[str], None],
) -> list[ProgramReport]:
    """FLOPs and bytes of scanned programs. XLA's cost analysis counts a loop body once, so the
    same programs are compiled unrolled at 1 and 2 layers and their cost extrapolated to the
    config's depth: cost(L) = cost(1) + (L - 1) * (cost(2) - cost(1)), exact when every layer
    is the same computation. Memory stays the scanned program's own."""
    depth = config.model.num_layers
    looped = {r.name for r in reports if r.status != FAILED}
    costs = []
    for n in (1, 2):
        shallow = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, num_layers=n),
            trainer=dataclasses.replace(config.trainer, scan_layers=False),
        )
        progress(f"counting FLOPs of the scanned programs: unrolled at {n} layer(s) ...")
        costs.append(
            {
                r.name: r
                for r in compile_all(
                    [p for p in build(shallow, devices) if p.runs_layers and p.name in looped],
                    component=component,
                    topology=topology,
                    device=device,
                )
            }
        )
    out = []
    for r in reports:
        one, two = costs[0].get(r.name), costs[1].get(r.name)
        if r.status == FAILED or one is None or two is None or FAILED in (one.status, two.status):
            out.append(r)
            continue
        flops = one.flops + (depth - 1) * (two.flops - one.flops)
        traffic = one.bytes_accessed + (depth - 1) * (two.bytes_accessed - one.bytes_accessed)
        out.append(
            dataclasses.replace(
                r,
                flops=flops,
                bytes_accessed=traffic,
                roofline_s=device.roofline_s(flops, traffic),
                note=f"{r.note} (FLOPs, bytes: unrolled 1- and 2-layer compiles, extrapolated to "
                f"{depth} layers)",
            )
        )
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_table(reports: list[ProgramReport], specs: dict[str, DeviceSpec]) -> str:
    head = (
        f"{'program':<24} {'topology':<11} {'status':<16} {'args GiB':>9} {'out GiB':>8} "
        f"{'temp GiB':>9} "
        f"{'peak GiB':>9} {'% HBM':>6} {'TFLOP':>9} {'GB moved':>9} {'roofline ms':>11} "
        f"{'compile s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        if r.status in (FITS, TOO_BIG) and r.argument_bytes:
            lines.append(
                f"{r.name:<24} {r.topology:<11} {r.status:<16} {_gib(r.argument_bytes):>9} "
                f"{_gib(r.output_bytes):>8} {_gib(r.temp_bytes):>9} {_gib(r.peak_bytes):>9} {100 * r.hbm_fraction:>6.1f} "
                f"{r.flops / 1e12:>9.3f} {r.bytes_accessed / 1e9:>9.2f} "
                f"{1e3 * r.roofline_s:>11.3f} {r.compile_s:>9.1f}"
            )
        else:
            lines.append(f"{r.name:<24} {r.topology:<11} {r.status:<16} {r.error}")
    lines.append("")
    for topo, spec in specs.items():
        c = spec.chip
        lines.append(
            f"{topo}: {c.name}, per device {_gib(spec.hbm_bytes)} GiB HBM "
            f"({_gib(spec.usable_hbm_bytes)} GiB usable, from the {spec.usable_hbm_source}), "
            f"{spec.bf16_flops / 1e12:.0f} TFLOP/s bf16, {spec.hbm_bandwidth / 1e9:.0f} GB/s "
            f"({spec.devices_per_chip} device(s) per chip; {c.source})"
        )
    notes = {r.name: r.note for r in reports if r.note}
    lines += [f"  {name}: {note}" for name, note in notes.items()]
    lines.append(
        "held beside each program (GiB per device; resident state and the transients "
        "of its moment):"
    )
    for r in reports:
        if r.held:
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in r.held.items())
            lines.append(f"  {r.name}: {parts}")
    lines.append(
        f"peak = arguments + outputs - donated + temporaries + held; fits = peak <= "
        f"{100 * (1 - HEADROOM):.0f}% of the usable HBM ({100 * HEADROOM:.0f}% headroom); "
        "FLOPs of Pallas kernels count only if the kernel declares them"
    )
    return "\n".join(lines)


class CheckError(ValueError):
    """Flags or a config the check cannot compile for (a usage error, exit code 2)."""


def compile_reports(
    config: RunConfig,
    *,
    topology: str,
    inference_topology: str,
    component: str,
    only: Sequence[str] = (),
    progress: Callable[[str], None] = lambda msg: None,
) -> tuple[list[ProgramReport], dict[str, DeviceSpec]]:
    """Compiles ``component``'s programs (``only`` these names, when given) for the topologies;
    returns their reports and each topology's device spec. Raises CheckError."""
    reports: list[ProgramReport] = []
    specs: dict[str, DeviceSpec] = {}
    built: list[tuple[str, Builder, list[AbstractProgram], list[jax.Device], str, DeviceSpec]] = []
    for name, build in _builders(component).items():
        topo = inference_topology if name == "inference" else topology
        slices = config.mesh.slices if name == "trainer" else 1
        try:
            devices = topology_devices(topo, slices)
        except TopologyError as e:
            raise CheckError(str(e)) from None
        if topo not in specs:
            specs[topo] = device_spec(topo, devices[0])
        spec = specs[topo]
        if slices > 1:
            topo = f"{slices}x{topo}"  # the report's name for the job's devices
        try:
            programs = build(config, devices)
        except ValueError as e:  # ConfigError (mesh), BatchShapeError (micro-batch rows)
            raise CheckError(
                f"the config's {name} does not fit topology {topo} ({len(devices)} devices): {e}"
            ) from None
        built.append((name, build, programs, devices, topo, spec))
    names = [p.name for _, _, programs, *_ in built for p in programs]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise CheckError(f"no program {', '.join(unknown)} here; the programs: {', '.join(names)}")
    for name, build, programs, devices, topo, spec in built:
        if only:
            programs = [p for p in programs if p.name in only]
            if not programs:
                continue
        compiled = compile_all(
            programs, component=name, topology=topo, device=spec, progress=progress
        )
        if name == "trainer" and config.trainer.scan_layers:
            compiled = cost_by_depth(
                config,
                build,
                devices,
                compiled,
                component=name,
                topology=topo,
                device=spec,
                progress=progress,
            )
        reports += compiled
    return reports, specs


def run_check(
    config: RunConfig,
    *,
    topology: str,
    inference_topology: str,
    component: str,
    json_path: Path | None,
    command: str,
    only: Sequence[str] = (),
) -> int:
    """Runs the check; returns the exit code (messages go to stdout/stderr). ``only``: the
    program names to compile (all of the component's when empty)."""
    try:
        reports, specs = compile_reports(
            config,
            topology=topology,
            inference_topology=inference_topology,
            component=component,
            only=only,
            progress=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    except CheckError as e:
        print(f"rlax_tpu.aot: error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    print(format_table(reports, specs))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {
                    "command": command,
                    "preset": config.preset,
                    "libtpu_init_args": os.environ.get(libtpu.ENV, ""),
                    "devices": {
                        t: {
                            "chip": s.chip.name,
                            "devices_per_chip": s.devices_per_chip,
                            "hbm_bytes": s.hbm_bytes,
                            "usable_hbm_bytes": s.usable_hbm_bytes,
                            "bf16_flops": s.bf16_flops,
                            "hbm_bandwidth": s.hbm_bandwidth,
                            "source": s.chip.source,
                        }
                        for t, s in specs.items()
                    },
                    "programs": [r.to_dict() for r in reports],
                },
                indent=2,
            )
        )
    bad = [r for r in reports if r.status != FITS]
    for r in bad:
        if r.status == TOO_BIG and r.argument_bytes:
            why = (
                f"needs {_gib(r.peak_bytes)} GiB per device ({_gib(r.footprint_bytes)} GiB "
                f"program + {_gib(r.resident_bytes)} GiB held beside it) of "
                f"{_gib(r.limit_bytes)} GiB ({_gib(r.hbm_bytes)} GiB usable HBM less "
                f"{100 * HEADROOM:.0f}% headroom)"
            )
        else:
            why = r.error
        print(f"rlax_tpu.aot: {r.name} {r.status} on {r.topology}: {why}", file=sys.stderr)
    return 1 if bad else 0
