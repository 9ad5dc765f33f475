"""Device meshes and multi-host jobs (shared by the trainer and inference sections)."""

from __future__ import annotations

import math

from rlax_tpu.config.checks import ConfigError, bad, frozen, non_negative, positive

# The mesh's axes, outermost first. expert sits inside fsdp: a MoE layer's token exchange over
# it is on every layer's critical path, fsdp's weight gathers can be issued ahead.
AXES = ("data", "fsdp", "expert", "tensor")


@frozen
class MeshConfig:
    """Device mesh axes. One axis may be -1: it takes the devices the others leave.

    ``expert`` splits a mixture-of-experts model's experts (each device holds 1/expert of them)
    and, like fsdp, the batch and the other parameters (expert parallelism carved out of data
    parallelism: models/moe.py); a dense model uses it as one more fsdp axis.

    With ``slices`` > 1 (multislice: TPU slices joined by the data-center network, DCN) data,
    fsdp, expert and tensor lay out each slice's devices over its own interconnect (ICI), and
    the mesh's data axis is ``slices`` x data: only data parallelism crosses slices, its one
    gradient all-reduce per step the traffic DCN carries (MaxText's default: "product of the
    DCN axes should equal number of slices", dcn_data_parallelism -1;
    src/maxtext/configs/base.yml).
    """

    data: int = 1  # data-parallel axis (batch rows), within a slice
    fsdp: int = -1  # fully sharded axis (parameters and batch)
    tensor: int = 1  # tensor-parallel axis (heads, MLP width)
    slices: int = 1  # TPU slices the mesh spans (data-parallel over DCN); the trainer's only
    expert: int = 1  # expert-parallel axis (a MoE's experts; batch and parameters as fsdp)

    def __post_init__(self) -> None:
        for n in AXES:
            if getattr(self, n) == 0 or getattr(self, n) < -1:
                raise bad(self, n, "must be >= 1, or -1 for 'the remaining devices'")
        if sum(getattr(self, n) == -1 for n in AXES) > 1:
            raise ConfigError("", "at most one of data, fsdp, expert, tensor may be -1")
        if self.expert == -1:  # its size must divide the model's experts: say it
            raise bad(self, "expert", "must be >= 1 (a size that divides the model's experts)")
        positive(self, "slices")

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """The configured sizes in :data:`AXES` order (-1 where one takes the rest)."""
        return tuple(getattr(self, n) for n in AXES)  # type: ignore[return-value]

    def global_shape(self, num_devices: int) -> tuple[int, int, int, int]:
        """The whole mesh's shape (:data:`AXES` order) over ``num_devices`` devices of every
        slice: the data axis is ``slices`` x the per-slice data degree."""
        if num_devices % self.slices:
            raise ConfigError(
                "mesh.slices", f"{num_devices} devices do not split into {self.slices} slices"
            )
        data, *rest = self.shape(num_devices // self.slices)
        return (data * self.slices, *rest)  # type: ignore[return-value]

    def shape(self, num_devices: int) -> tuple[int, int, int, int]:
        """The shape (:data:`AXES` order) for ``num_devices`` devices of one slice; raises
        ConfigError if they don't fit."""
        sizes = list(self.sizes)
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ConfigError(
                    "mesh",
                    f"{num_devices} devices are not divisible by the fixed axes' product {known}",
                )
            sizes[sizes.index(-1)] = num_devices // known
        elif known != num_devices:
            raise ConfigError(
                "mesh", f"data*fsdp*expert*tensor = {known} but {num_devices} devices exist"
            )
        return tuple(sizes)  # type: ignore[return-value]


@frozen
class DistributedConfig:
    """How a component spanning several hosts joins its ``jax.distributed`` job.

    ``coordinator_address`` "": one process, nothing is started. "auto": jax.distributed finds
    everything in the environment (TPU VM metadata, a GKE JobSet's variables). "host:port":
    process 0 runs the coordinator there and every process names its own ``process_id``. JAX's
    coordinator has no credentials: keep it on the job's private network.
    """

    coordinator_address: str = ""  # "" one process; "auto"; or "host:port" of process 0
    num_processes: int = 1  # processes in the job (one per host), of every slice
    process_id: int = 0  # this process's index, with a host:port coordinator
    # Multislice: this process's slice, when process_id counts within the slice (a GKE pod
    # knows its slice's job index and its index in that job, not their product). The job's
    # index of the process is slice_index x (num_processes / mesh.slices) + process_id.
    slice_index: int = 0
    initialization_timeout_s: int = 300  # how long processes wait for each other to join
    # How fast a failure ends the job: a process silent this long is dead and every process
    # ends (jax.distributed's heartbeat timeout, 100 s by default there); a process whose call
    # failed waits this long for the others (they may wait in a collective it never entered).
    # Heartbeats come from a C++ thread: compiles and long steps do not delay them.
    heartbeat_timeout_s: int = 20
    # A process alive but stuck (a hung host, a deadlock) keeps its heartbeats: a call the
    # processes run in step (a trainer call: step, publish, save, restore; an engine step with
    # its loads) that has not ended this long after it started on a process ends the job. The
    # first calls compile and restore: keep it above the longest of those. 0: unbounded.
    call_timeout_s: int = 1800

    def __post_init__(self) -> None:
        positive(self, "num_processes", "initialization_timeout_s", "heartbeat_timeout_s")
        non_negative(self, "call_timeout_s")
        non_negative(self, "slice_index")
        if self.coordinator_address not in ("", "auto"):
            host, sep, port = self.coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise bad(self, "coordinator_address", "must be '', 'auto' or 'host:port'")
            if not 0 <= self.process_id < self.num_processes:
                raise bad(self, "process_id", f"must be in [0, num_processes={self.num_processes})")
        elif self.coordinator_address == "" and self.num_processes != 1:
            raise bad(self, "num_processes", "needs a coordinator_address ('auto' or 'host:port')")

    @property
    def enabled(self) -> bool:
        return self.coordinator_address != ""

    def job_process_id(self, slices: int = 1) -> int:
        """This process's index in the whole job, over ``slices`` slices."""
        return self.slice_index * (self.num_processes // slices) + self.process_id


def one_device() -> MeshConfig:
    return MeshConfig(data=1, fsdp=1, tensor=1)
