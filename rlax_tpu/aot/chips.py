"""TPU chip specs (published numbers, with their source) and the HBM the compiler lets a program use.

A topology device is a chip, or one TensorCore of it where the topology runs cores as separate
devices (libtpu's compile-only ``v4`` topologies do: 8 devices for ``v4:2x2x1``), so per-device
numbers are the chip's divided by ``devices_per_chip``.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    name: str
    hbm_bytes: int  # per chip
    bf16_flops: float  # peak dense bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    cores: int  # TensorCores per chip
    source: str


# Google Cloud's "TPU versions" pages (system architecture), read 2026-11.
CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1200e9, 2, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": ChipSpec("v5e", 16 * GiB, 197e12, 819e9, 1, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec("v5p", 95 * GiB, 459e12, 2765e9, 2, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipSpec("v6e", 32 * GiB, 918e12, 1640e9, 1, "https://cloud.google.com/tpu/docs/v6e"),
}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One topology device's share of its chip, and the HBM the TPU compiler allows it."""

    chip: ChipSpec
    devices_per_chip: int
    usable_hbm_bytes: int  # the compiler's limit (below the chip's HBM: reserved memory)
    usable_hbm_source: str  # "compiler" (probed) or "table" (the probe's message was not parsed)

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes // self.devices_per_chip

    @property
    def bf16_flops(self) -> float:
        return self.chip.bf16_flops / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip

    def roofline_s(self, flops: float, bytes_accessed: float) -> float:
        """Lower bound on run time: the slower of compute at peak and HBM traffic at peak."""
        return max(flops / self.bf16_flops, bytes_accessed / self.hbm_bandwidth)


def chip_of(topology: str) -> ChipSpec:
    """The chip of a topology name like ``v5p:4x8x8``; KeyError naming the known chips."""
    name = topology.split(":", 1)[0].strip().lower()
    if name not in CHIPS:
        raise KeyError(
            f"no chip specs for {name!r} (topology {topology!r}); known: {', '.join(CHIPS)}"
        )
    return CHIPS[name]


_SIZE = re.compile(r"([0-9.]+)\s*([KMGT]?)i?B?\b")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'15.75G' -> bytes (XLA prints binary units)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


_AVAILABLE = re.compile(r"available HBM \(([0-9.]+\s*[KMGT]?)\)|of ([0-9.]+\s*[KMGT]?) hbm", re.I)


def hbm_limit_from_error(message: str) -> int | None:
    """The HBM limit an XLA:TPU out-of-memory message names, if it names one."""
    m = _AVAILABLE.search(message)
    return parse_size(m.group(1) or m.group(2)) if m else None


def device_spec(topology: str, device: jax.Device) -> DeviceSpec:
    """``device``'s spec; the usable HBM is probed by compiling a program that cannot fit
    (the compiler's refusal names its limit)."""
    chip = chip_of(topology)
    per_chip = max(1, chip.cores // max(1, getattr(device, "num_cores", chip.cores)))
    too_big = jax.ShapeDtypeStruct(  # twice a chip's HBM, f32
        (chip.hbm_bytes // 2,), jnp.float32, sharding=SingleDeviceSharding(device)
    )
    limit = None
    try:
        jax.jit(lambda x: x + 1).lower(too_big).compile()
    except Exception as e:  # noqa: BLE001 - the expected out-of-memory refusal
        limit = hbm_limit_from_error(str(e))
    if limit is None:
        return DeviceSpec(chip, per_chip, chip.hbm_bytes // per_chip, "table")
    return DeviceSpec(chip, per_chip, limit, "compiler")
