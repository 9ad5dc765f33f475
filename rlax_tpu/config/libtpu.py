"""The XLA/libtpu flags of the TPU jobs, in one place: what ``LIBTPU_INIT_ARGS`` holds for the
trainer's and the inference workers' processes (the launchers: local on a TPU host, TPU VM, GKE)
and for the ahead-of-time check (``python -m rlax_tpu.aot``), so that what is compiled there is
what runs.

libtpu reads ``LIBTPU_INIT_ARGS`` once, when its plugin loads, and refuses an unknown flag; with
these flags the pinned libtpu compiles an FSDP gradient's all-gathers and reduce-scatters as
asynchronous collective fusions, without them synchronously (``tests/config/test_libtpu.py``
holds the three facts).

What "auto" sets, from AI-Hypercomputer/maxtext ``benchmarks/xla_flags_library.py`` (its flag
groups, which its benchmark recipes combine per model):
- the trainer: ``CF_FOR_ALL_GATHER``, collective fusion and compute/collective overlap for FSDP's
  all-gathers (``xla_tpu_enable_async_collective_fusion`` with ``_fuse_all_gather`` and
  ``_multiple_steps``, ``xla_tpu_overlap_compute_collective_tc``, ``xla_enable_async_all_gather``;
  MaxText notes them as on by default, which the pinned libtpu is not, per the test above); with
  slices over the data-center network (``mesh.slices`` > 1) also ``DATA_PARALLEL_OVERLAP``
  (``xla_tpu_enable_data_parallel_all_reduce_opt``, ``xla_tpu_data_parallel_opt_different_sized_ops``:
  MaxText's "optimize DCN all-reduces used for data parallel sharding");
- every TPU process: MaxText's scoped VMEM limit, ``_DENSE_VMEM_LIMIT`` 98304 KiB or, for MoE
  models, ``_MOE_VMEM_LIMIT`` 81920 KiB (``xla_tpu_scoped_vmem_limit_kib``). The project's own
  Pallas kernels compile within libtpu's default too (``tests/aot``); the limit is what XLA's
  fusions and kernels may take beyond it, and it is measured only as far as the AOT reports go.
The inference workers' tensor-parallel all-reduces get no overlap flag: none is measured here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlax_tpu.config import RunConfig

ENV = "LIBTPU_INIT_ARGS"
COLLECTIVE_OVERLAP = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)
DATA_PARALLEL_OVER_DCN = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)
DENSE_VMEM_KIB = 98304
MOE_VMEM_KIB = 81920


def libtpu_init_args(config: RunConfig, component: str = "trainer") -> str:
    """``LIBTPU_INIT_ARGS`` for the config's ``component`` on TPUs: "inference" takes the
    workers' flags, any other (the trainer, a process running both, as the local transport's
    controller does) the trainer's; ``topology.libtpu_init_args`` as written, or for "auto" the
    flags above."""
    chosen = config.topology.libtpu_init_args
    if chosen != "auto":
        return chosen
    flags: list[str] = []
    if component == "trainer":
        flags += COLLECTIVE_OVERLAP
        if config.mesh.slices > 1:
            flags += DATA_PARALLEL_OVER_DCN
    vmem = MOE_VMEM_KIB if config.model.num_experts else DENSE_VMEM_KIB
    flags.append(f"--xla_tpu_scoped_vmem_limit_kib={vmem}")
    return " ".join(flags)
