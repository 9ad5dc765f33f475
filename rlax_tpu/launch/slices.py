"""TPU slices as GKE schedules them: hosts, chips per host and the node labels that select them.

A slice is named as ``python -m rlax_tpu.aot`` names topologies, ``<generation>:<topology>``
("v5p:8x8x4": 256 chips). GKE's TPU node pools carry ``cloud.google.com/gke-tpu-accelerator``
and ``cloud.google.com/gke-tpu-topology`` labels; a multi-host slice is one node per host, each
pod asking for all the host's chips (``google.com/tpu``). Numbers from Google Cloud's "Plan TPUs
in GKE" page (read 2026-11): v4 and v5p hosts hold 4 chips; v5e and v6e slices of up to 8 chips
are one host (2x4: 8 chips), larger ones 4 chips per host. JAX sees one device per chip on all
of them (v4 and v5p run their two TensorCores as one megacore device).
"""

from __future__ import annotations

import dataclasses
import math

GKE_ACCELERATOR = {
    "v4": "tpu-v4-podslice",
    "v5e": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}
_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    generation: str  # "v5p"
    topology: str  # "8x8x4" (the gke-tpu-topology label)
    chips: int
    hosts: int
    chips_per_host: int

    @property
    def name(self) -> str:
        return f"{self.generation}:{self.topology}"

    @property
    def gke_accelerator(self) -> str:
        return GKE_ACCELERATOR[self.generation]

    @property
    def devices(self) -> int:
        """JAX devices over the whole slice (one per chip)."""
        return self.chips


def parse_slice(name: str) -> TpuSlice:
    """``"v5p:2x2x1"`` -> its chips and hosts. ValueError for an unknown generation or a shape
    the generation does not have."""
    generation, _, topology = name.partition(":")
    if generation not in _DIMS:
        raise ValueError(
            f"unknown TPU generation {generation!r} in {name!r}; known: {', '.join(_DIMS)}"
        )
    try:
        dims = [int(d) for d in topology.split("x")]
    except ValueError:
        raise ValueError(f"bad TPU topology {topology!r} in {name!r}") from None
    if len(dims) != _DIMS[generation] or min(dims) < 1:
        raise ValueError(
            f"{generation} topologies have {_DIMS[generation]} dimensions, got {topology!r}"
        )
    chips = math.prod(dims)
    if _DIMS[generation] == 2 and chips <= 8:
        per_host = chips  # v5e / v6e single-host slices: 1x1, 2x2, 2x4
    else:
        per_host = 4
        if chips % 4:
            raise ValueError(
                f"a multi-host {generation} slice has a multiple of 4 chips; {name} has {chips}"
            )
    return TpuSlice(generation, topology, chips, chips // per_host, per_host)


# Cloud TPU's accelerator-type names count TensorCores on v4 and v5p (two per chip), chips on
# v5e ("v5litepod") and v6e.
_VM_PREFIX = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5e": ("v5litepod", 1), "v6e": ("v6e", 1)}


def tpu_vm_accelerator(tpu: TpuSlice) -> str:
    """The ``gcloud compute tpus tpu-vm create --accelerator-type`` of a slice, e.g.
    v5p:2x2x2 -> "v5p-16", v5e:2x4 -> "v5litepod-8"."""
    prefix, per_chip = _VM_PREFIX[tpu.generation]
    return f"{prefix}-{tpu.chips * per_chip}"
