"""The staleness policy (DESIGN.md §3): reload staleness η_r, acceptance staleness η_a.

Version ``v`` = number of optimizer updates applied to the initial weights; update ``s`` turns version
``s`` into ``s + 1`` and consumes the batch of training step ``s``. Workers reload only at versions
that are multiples of η_r.

Deterministic mode: the batch of step ``s`` is generated with version

    g(s) = η_r · ⌊max(0, s − d) / η_r⌋          (d = pipeline depth)

i.e. generation for step s starts once version s − d exists (so it overlaps the training of steps
s − d … s − 1) on the newest reload point at or below it. Its staleness at consumption is
s − g(s) ≤ d + η_r − 1, which the config requires to be ≤ η_a. d = 0, η_r = 1 is on-policy
lock-step; d = 1, η_r = 1 is one-step off-policy.

Throughput mode: a generation on worker version ``w`` may start while the trainer is at version
``v`` only if the rollouts already queued ahead of it (in flight or buffered, ``q``) leave room for it
to be consumed within η_a at B rollouts per update: ``q < B · (η_a − (v − w) + 1)``. With w = v this is
AReaL's in-flight budget B · (1 + η_a).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rlax_tpu.config import ControllerConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class StalenessPolicy:
    reload_staleness: int  # η_r >= 1
    acceptance_staleness: float  # η_a >= 0, math.inf for unbounded
    pipeline_depth: int = 0  # d, deterministic mode only

    def __post_init__(self) -> None:
        if self.reload_staleness < 1:
            raise ValueError(f"reload_staleness must be >= 1, got {self.reload_staleness}")
        if self.acceptance_staleness < 0 or self.pipeline_depth < 0:
            raise ValueError("acceptance_staleness and pipeline_depth must be >= 0")

    @classmethod
    def of(cls, cc: ControllerConfig) -> StalenessPolicy:
        """The policy of ``controller`` settings (pipeline depth only in deterministic mode)."""
        return cls(
            reload_staleness=cc.reload_staleness,
            acceptance_staleness=cc.acceptance_bound,
            pipeline_depth=cc.pipeline_depth if cc.mode == "deterministic" else 0,
        )

    def reload_point(self, version: int) -> int:
        """The version a worker holds when the newest published version is ``version``."""
        return self.reload_staleness * (version // self.reload_staleness)

    def generation_version(self, step: int) -> int:
        """g(step) of deterministic mode (see the module docstring)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.reload_point(max(0, step - self.pipeline_depth))

    def max_deterministic_staleness(self) -> int:
        return self.pipeline_depth + self.reload_staleness - 1

    def accepts(self, consumer_version: int, rollout_version: int) -> bool:
        """May the update from ``consumer_version`` consume a rollout of ``rollout_version``?"""
        if rollout_version > consumer_version:
            raise ValueError(
                f"rollout version {rollout_version} > consuming version {consumer_version}"
            )
        return consumer_version - rollout_version <= self.acceptance_staleness

    def consumption(
        self, consumer_version: int, versions: Sequence[int], batch: int, *, freshest_first: bool
    ) -> list[int]:
        """Indices of the (at most) ``batch`` ready rollouts, of ``versions`` in the order they
        were buffered (all acceptable), that the update from ``consumer_version`` takes: the
        oldest; or the freshest, after the fewest oldest that the next updates (``batch`` each)
        could not all take before they age past η_a (earliest deadline first, for whatever
        would otherwise be generated in vain). Ties keep the buffered order."""
        oldest = sorted(range(len(versions)), key=lambda i: versions[i])
        if not freshest_first:
            return oldest[:batch]
        must = 0
        if not math.isinf(self.acceptance_staleness):
            for count, i in enumerate(oldest, 1):
                later = versions[i] + int(self.acceptance_staleness) - consumer_version
                must = max(must, count - later * batch)
        first = oldest[: min(must, batch)]
        taken = set(first)
        rest = sorted((i for i in oldest if i not in taken), key=lambda i: -versions[i])
        return first + rest[: batch - len(first)]

    def admission_budget(self, batch: int, trainer_version: int, worker_version: int) -> float:
        """How many rollouts may be queued (in flight + buffered) before a new one is admitted."""
        if worker_version > trainer_version:
            raise ValueError(f"worker version {worker_version} > trainer version {trainer_version}")
        if math.isinf(self.acceptance_staleness):
            return math.inf
        return batch * max(0.0, self.acceptance_staleness - (trainer_version - worker_version) + 1)

    def admits(self, queued: int, batch: int, trainer_version: int, worker_version: int) -> bool:
        return queued < self.admission_budget(batch, trainer_version, worker_version)
