"""The TPU slices Cloud TPU and GKE offer, as ``<generation>:<topology>`` ("v5p:4x8x8").

One table, read by config validation (topology.trainer_tpu / inference_tpu), the GKE and TPU VM
renderers and ``python -m rlax_tpu.aot``, so a shape no node pool carries is refused before
anything is compiled or deployed. From the Cloud TPU docs (read 2026-11):

* v4 and v5p (3-D, 4 chips per host; https://cloud.google.com/tpu/docs/types-topologies: "The
  representation of a v4 topology is AxBxC where A<=B<=C and A, B, C are all <= 4 or all
  integer multiples of 4"; https://cloud.google.com/tpu/docs/v5p lists 2x2x1, 2x2x2, 2x4x4,
  4x4x4, 4x4x8, 4x8x8 (256 chips, 64 hosts) ... 16x16x24, written so). 2x2x1 is the one
  single-host slice.
* v5e and v6e (2-D; https://cloud.google.com/tpu/docs/v5e, https://cloud.google.com/tpu/docs/v6e):
  1x1, 2x2 and 2x4 are one host (1, 4, 8 chips), 4x4 ... 16x16 are multi-host, 4 chips per
  host on GKE's ct5lp-hightpu-4t / ct6e-standard-4t machines.

GKE's ``cloud.google.com/gke-tpu-topology`` labels use the same strings, so the dimensions are
written in ascending order: "8x8x4" names no node pool (its 256 chips are "4x8x8").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
# v5e / v6e: every documented shape (chips = product).
_PLANAR = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# v4 / v5p: the slices within one 4x4x4 cube, as the v5p table writes them (2x2x1 is one
# host); larger ones are whole cubes, AxBxC with A<=B<=C all multiples of 4.
_WITHIN_A_CUBE = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4")
_CHIPS_PER_HOST = 4  # v4 and v5p hosts; v5e and v6e multi-host slices on GKE


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    generation: str  # "v5p"
    topology: str  # "4x8x8" (the gke-tpu-topology label)
    chips: int
    hosts: int  # VMs (GKE nodes), one JAX process each
    chips_per_host: int

    @property
    def name(self) -> str:
        return f"{self.generation}:{self.topology}"

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.topology.split("x"))

    @property
    def devices(self) -> int:
        """JAX devices over the whole slice (one per chip: v4 and v5p run a chip's two
        TensorCores as one megacore device)."""
        return self.chips


def offered(generation: str, dims: list[int]) -> bool:
    """Whether Cloud TPU offers this shape, written in this order."""
    shape = "x".join(map(str, dims))
    if _DIMS[generation] == 2:
        return shape in _PLANAR
    return shape in _WITHIN_A_CUBE or (dims == sorted(dims) and all(d % 4 == 0 for d in dims))


def parse_slice(name: str) -> TpuSlice:
    """``"v5p:2x2x1"`` -> its chips and hosts. ValueError, saying what to write instead, for an
    unknown generation or a shape Cloud TPU does not offer (or writes in another order)."""
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
    if not offered(generation, dims):
        ascending = sorted(dims)
        if ascending != dims and offered(generation, ascending):
            hint = (
                f"write it {generation}:{'x'.join(map(str, ascending))} (GKE's "
                "gke-tpu-topology labels list the dimensions in ascending order)"
            )
        elif _DIMS[generation] == 2:
            hint = f"{generation} slices are {', '.join(_PLANAR)}"
        else:
            hint = (
                f"{generation} slices are {', '.join(_WITHIN_A_CUBE)} or whole 4x4x4 cubes "
                "(AxBxC with A<=B<=C, each a multiple of 4, e.g. 4x4x8, 4x8x8)"
            )
        raise ValueError(f"Cloud TPU offers no {name} slice: {hint}")
    chips = math.prod(dims)
    single_host = chips <= (8 if _DIMS[generation] == 2 else _CHIPS_PER_HOST)
    per_host = chips if single_host else _CHIPS_PER_HOST
    return TpuSlice(generation, topology, chips, chips // per_host, per_host)


def lays_out(mesh_shape: Sequence[int], dims: Sequence[int]) -> bool:
    """Whether JAX lays a mesh of ``mesh_shape`` over a slice of physical ``dims`` without
    splitting a torus axis, which jax.make_mesh refuses (NotImplementedError). Its rule
    (jax/_src/mesh_utils.py, _create_device_mesh_for_nd_torus): from the last mesh axis to the
    first, each axis of size > 1 takes the first set of still-free physical axes, larger sets
    first, whose sizes multiply to its size; a mesh axis no such set matches fails the layout.
    E.g. (1, 16, 4) fits 4x4x4, (1, 8, 8) does not; (1, 32, 8) fits 4x8x8."""
    free = list(dims)
    for size in reversed(mesh_shape):
        if size == 1:
            continue
        picked = next(
            (
                axes
                for k in range(len(free), 0, -1)
                for axes in itertools.combinations(range(len(free)), k)
                if math.prod(free[i] for i in axes) == size
            ),
            None,
        )
        if picked is None:
            return False
        free = [0 if i in picked else d for i, d in enumerate(free)]
    return True
