"""The XLA/libtpu flags of every TPU job, in one place: what ``LIBTPU_INIT_ARGS`` holds for the
trainer's and the inference workers' processes (the launchers: local, TPU VM, GKE) and for the
ahead-of-time check (``python -m rlax_tpu.aot``), so that what is compiled there is what runs.

libtpu reads ``LIBTPU_INIT_ARGS`` once, when it loads, and refuses an unknown flag
(``tests/config/test_libtpu.py`` holds both facts against the pinned libtpu).

Sources (the flags every MaxText TPU training job sets, read in its XLA flag library and its
published v5p recipes; each flag's meaning per the XLA TPU flag names):
- collectives overlapped with compute, so FSDP's all-gathers and reduce-scatters and the data
  axis's all-reduces are not exposed: ``xla_tpu_enable_async_collective_fusion`` (and its
  ``_fuse_all_gather``, ``_multiple_steps``), ``xla_tpu_overlap_compute_collective_tc``,
  ``xla_enable_async_all_gather`` (AI-Hypercomputer/maxtext ``benchmarks/xla_flags_library.py``;
  gclouduniverse/reproducibility ``Training/TPU-v5p/*/env.sh``);
- the data-parallel all-reduce optimizations ``xla_tpu_enable_data_parallel_all_reduce_opt``,
  ``xla_tpu_data_parallel_opt_different_sized_ops`` (MaxText's ``end_to_end/tpu`` scripts);
- the scoped VMEM a Pallas kernel may take, 96 MiB for dense models and 80 MiB for MoE (MaxText's
  ``DENSE_VMEM_LIMIT`` / ``MOE_VMEM_LIMIT``): above libtpu's default, which the paged-attention
  and grouped-matmul kernels' larger blocks need.
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
DATA_PARALLEL = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)
DENSE_VMEM_KIB = 96 * 1024
MOE_VMEM_KIB = 80 * 1024


def libtpu_init_args(config: RunConfig) -> str:
    """``LIBTPU_INIT_ARGS`` for the config's TPU processes: ``topology.libtpu_init_args`` as
    written, or for "auto" the flags above (the VMEM limit by whether the model is MoE)."""
    chosen = config.topology.libtpu_init_args
    if chosen != "auto":
        return chosen
    vmem = MOE_VMEM_KIB if config.model.num_experts else DENSE_VMEM_KIB
    return " ".join(
        (*COLLECTIVE_OVERLAP, *DATA_PARALLEL, f"--xla_tpu_scoped_vmem_limit_kib={vmem}")
    )
