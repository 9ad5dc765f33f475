"""TPU slices as GKE schedules them: hosts, chips per host and the node labels that select them.

A slice is named as ``python -m rlax_tpu.aot`` names topologies, ``<generation>:<topology>``
("v5p:4x8x8": 256 chips); the shapes offered and their hosts are rlax_tpu.config.slices' table.
GKE's TPU node pools carry ``cloud.google.com/gke-tpu-accelerator`` and
``cloud.google.com/gke-tpu-topology`` labels; a multi-host slice is one node per host, each pod
asking for all the host's chips (``google.com/tpu``).
"""

from __future__ import annotations

from rlax_tpu.config.slices import TpuSlice, parse_slice

__all__ = ["GKE_ACCELERATOR", "TpuSlice", "gke_accelerator", "parse_slice", "tpu_vm_accelerator"]
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
