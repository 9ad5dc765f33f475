"""TPU slices as GKE schedules them: hosts, chips per host and the node labels that select them.

A slice is named as ``python -m rlax_tpu.aot`` names topologies, ``<generation>:<topology>``
("v5p:4x8x8": 256 chips); the shapes offered and their hosts are rlax_tpu.config.slices' table.
GKE's TPU node pools carry ``cloud.google.com/gke-tpu-accelerator`` and
``cloud.google.com/gke-tpu-topology`` labels; a multi-host slice is one node per host, each pod
asking for all the host's chips (``google.com/tpu``).
"""

from __future__ import annotations

import dataclasses

from rlax_tpu.config.slices import TpuSlice, parse_slice

__all__ = [
    "GKE_ACCELERATOR",
    "TPU_VMS",
    "Machine",
    "TpuSlice",
    "gke_accelerator",
    "gke_allocatable",
    "parse_slice",
    "schedulable",
    "tpu_vm",
    "tpu_vm_accelerator",
]
GKE_ACCELERATOR = {
    "v4": "tpu-v4-podslice",
    "v5e": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}


def gke_accelerator(tpu: TpuSlice) -> str:
    """The ``cloud.google.com/gke-tpu-accelerator`` node label of the slice's node pools."""
    return GKE_ACCELERATOR[tpu.generation]


# Cloud TPU's accelerator-type names count TensorCores on v4 and v5p (two per chip), chips on
# v5e ("v5litepod") and v6e.
_VM_PREFIX = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5e": ("v5litepod", 1), "v6e": ("v6e", 1)}


def tpu_vm_accelerator(tpu: TpuSlice) -> str:
    """The ``gcloud compute tpus tpu-vm create --accelerator-type`` of a slice, e.g.
    v5p:2x2x2 -> "v5p-16", v5e:2x4 -> "v5litepod-8"."""
    prefix, per_chip = _VM_PREFIX[tpu.generation]
    return f"{prefix}-{tpu.chips * per_chip}"


# -- machines: what a node has, and what of it GKE leaves to pods --------------------------------

GB, GiB, MiB = 10**9, 2**30, 2**20


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str  # Compute Engine machine type
    vcpus: int
    memory_gb: float  # as Compute Engine lists it, read as 10**9 bytes (the smaller reading)
    source: str  # where the numbers come from ("UNSOURCED: ..." when nothing was found)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)


_V5E = "https://cloud.google.com/tpu/docs/v5e (VM types: vCPUs and RAM (GB) per VM)"
_V5P = (
    "https://cloud.google.com/tpu/docs/v5p (v5p-training: 'Number of vCPUs (4-chip VM) 208', "
    "'RAM (GB) (4-chip VM) 448')"
)
_STAND_IN = (
    "UNSOURCED: no Cloud TPU page with this machine's vCPUs and memory was found (2026-11); "
    "stands in with the smallest documented TPU VM of as many chips or more (v5e's), so the "
    "pod's requests stay below what the node has (under-asking only loosens the guarantee)"
)
# The TPU VM (GKE node) of each generation and chips per host: GKE's machine types
# (xpk's system_characteristics; https://cloud.google.com/tpu/docs/v5e, .../v6e).
TPU_VMS = {
    ("v5e", 1): Machine("ct5lp-hightpu-1t", 24, 48, _V5E),
    ("v5e", 4): Machine("ct5lp-hightpu-4t", 112, 192, _V5E),
    ("v5e", 8): Machine("ct5lp-hightpu-8t", 224, 384, _V5E),
    ("v5p", 4): Machine("ct5p-hightpu-4t", 208, 448, _V5P),
    ("v4", 4): Machine("ct4p-hightpu-4t", 112, 192, _STAND_IN),
    ("v6e", 1): Machine("ct6e-standard-1t", 24, 48, _STAND_IN),
    ("v6e", 4): Machine("ct6e-standard-4t", 112, 192, _STAND_IN),
    ("v6e", 8): Machine("ct6e-standard-8t", 112, 192, _STAND_IN),
}


def tpu_vm(tpu: TpuSlice) -> Machine:
    """The machine each host of the slice is (a GKE node)."""
    return TPU_VMS[(tpu.generation, tpu.chips_per_host)]


# GKE's node reservations (allocatable = capacity - reserved - eviction threshold), from
# https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes#memory_and_cpu_reservations
# (its text as quoted by GKE multi-cloud's release notes and by
# github.com/hatemosphere/gke-node-allocatable-memory-calculator, read 2026-11): CPU "6% of the
# first core, 1% of the next core, 0.5% of the next 2 cores, 0.25% of any cores above 4 cores";
# memory "255 MiB for machines with less than 1GB of memory, 25% of the first 4GB of memory, 20%
# of the next 4GB, 10% of the next 8GB, 6% of the next 112GB, 2% of any memory above 128GB"
# (tiers in GiB here), and "100 MiB of memory on each node for the eviction threshold".
_CPU_TIERS = ((1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025))
_MEMORY_TIERS = ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02))
EVICTION_BYTES = 100 * MiB
# What GKE's own DaemonSets request on every node (kube-proxy, fluentbit-gke,
# gke-metadata-server, netd, pdcsi-node, gke-metrics-agent; the TPU device plugin on TPU nodes):
# an allowance, not a measured number (INFERENCE: each asks for a tenth of a CPU or less and
# tens to hundreds of MiB).
SYSTEM_PODS = (1.0, 2 * GiB)


def _tiered(amount: float, tiers: tuple[tuple[float, float], ...]) -> float:
    reserved, left = 0.0, amount
    for size, rate in tiers:
        part = min(left, size)
        reserved += part * rate
        left -= part
        if left <= 0:
            break
    return reserved


def gke_allocatable(machine: Machine) -> tuple[float, float]:
    """(CPUs, memory bytes) a GKE Standard node of ``machine`` offers pods (its allocatable)."""
    cpu = machine.vcpus - _tiered(machine.vcpus, _CPU_TIERS)
    gib = machine.memory_bytes / GiB
    reserved = 255 * MiB if gib < 1 else _tiered(gib, _MEMORY_TIERS) * GiB
    return cpu, machine.memory_bytes - reserved - EVICTION_BYTES


def schedulable(machine: Machine) -> tuple[float, float]:
    """(CPUs, memory bytes) of ``machine`` left for the run's pods: its allocatable less
    SYSTEM_PODS."""
    cpu, memory = gke_allocatable(machine)
    return cpu - SYSTEM_PODS[0], memory - SYSTEM_PODS[1]
