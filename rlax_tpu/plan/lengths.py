"""How long groups take relative to the mean sample, from a distribution of completion lengths.

Under continuous batching a group's rows are busy for its samples' tokens, so it holds its slot
for about its mean sample (``occupancy``), but it is done (and can be verified) only when its
longest sample is (``latency``). Both are factors of the workload's mean completion, which the
costs are made with; a group draws them from one of:

* ``fixed``: every sample the mean length (both factors 1: the planner before distributions);
* ``lognormal:CV``: G samples a group, lognormal with the workload's mean completion and
  coefficient of variation CV, cut at ``inference.max_new_tokens`` (RL completions are
  right-skewed, and the budget truncates them);
* a run's own groups: the completion lengths its metrics record for every trained group
  (the ``lengths/trained`` histogram, G consecutive values a group), drawn whole.

Draws are seeded, so a plan is reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from pathlib import Path

from rlax_tpu.observability.metrics import read_metrics


@dataclasses.dataclass(frozen=True)
class GroupLengths:
    """Groups of completion lengths (tokens, G a group) to draw from; ``describe`` names them."""

    groups: tuple[tuple[float, ...], ...]
    describe: str

    def __post_init__(self) -> None:
        if not self.groups or any(not g or min(g) <= 0 for g in self.groups):
            raise ValueError("groups must be non-empty, of lengths > 0")

    @property
    def mean(self) -> float:
        """The mean sample's length over every group."""
        return math.fsum(x for g in self.groups for x in g) / sum(len(g) for g in self.groups)

    def factors(self) -> list[tuple[float, float]]:
        """Each group's (occupancy, latency): its mean and its longest sample over ``mean``."""
        mu = self.mean
        return [(math.fsum(g) / len(g) / mu, max(g) / mu) for g in self.groups]

    def drawer(self, seed: int = 0):  # noqa: ANN201
        """A function drawing one group's (occupancy, latency), seeded."""
        rng, table = random.Random(seed), self.factors()
        if len(table) == 1:
            return lambda: table[0]
        return lambda: table[rng.randrange(len(table))]

    def expected_max_latency(self, groups: int, seed: int = 0, trials: int = 256) -> float:
        """The mean over ``trials`` of the longest latency among ``groups`` drawn groups: a
        batch of groups started together is done when its slowest is."""
        draw = self.drawer(seed)
        return math.fsum(max(draw()[1] for _ in range(groups)) for _ in range(trials)) / trials


def fixed() -> GroupLengths:
    return GroupLengths(((1.0,),), "fixed (every sample the mean length)")


def lognormal(
    mean: float, cv: float, group_size: int, cap: float, *, seed: int = 0, groups: int = 2048
) -> GroupLengths:
    """``groups`` groups of ``group_size`` lengths, lognormal of mean ``mean`` and coefficient
    of variation ``cv`` (before the cut), each cut to [1, cap]."""
    if not (mean > 0 and cv >= 0 and cap >= 1 and group_size >= 1):
        raise ValueError("lognormal lengths need mean > 0, CV >= 0, cap >= 1 and a group size")
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma²))] = mean
    rng = random.Random(seed)
    drawn = tuple(
        tuple(min(cap, max(1.0, rng.lognormvariate(mu, sigma))) for _ in range(group_size))
        for _ in range(groups)
    )
    return GroupLengths(drawn, f"lognormal (mean {mean:.0f}, CV {cv:g}, cut at {cap:.0f})")


class NoLengths(ValueError):
    """The run's metrics record no lengths (a run from before they were recorded)."""


def from_run(run_dir: str | Path, group_size: int, *, skip: int = 0) -> GroupLengths:
    """Every trained group's completion lengths in a run's metrics (``lengths/trained``), after
    its first ``skip`` steps. Raises NoLengths when the run recorded none, ValueError when they
    are not whole groups."""
    groups: list[tuple[float, ...]] = []
    for record in read_metrics(run_dir):
        lengths: Sequence[float] = record.get("histograms", {}).get("lengths/trained", ())
        if record.get("step", 0) <= skip or not lengths:
            continue
        if len(lengths) % group_size:
            raise ValueError(
                f"{run_dir}: step {record.get('step')} trained {len(lengths)} completions, not "
                f"whole groups of {group_size}"
            )
        groups += [
            tuple(float(x) for x in lengths[i : i + group_size])
            for i in range(0, len(lengths), group_size)
        ]
    if not groups:
        raise NoLengths(f"{run_dir}: its metrics record no lengths/trained (a run before them)")
    return GroupLengths(tuple(groups), f"{len(groups)} groups of {run_dir}")


def parse(spec: str, *, mean: float, group_size: int, cap: float, seed: int = 0) -> GroupLengths:
    """``fixed``, ``lognormal:CV`` or ``run:RUN_DIR`` (module docstring)."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed" and not arg:
        return fixed()
    if kind == "lognormal" and arg:
        try:
            cv = float(arg)
        except ValueError:
            raise ValueError(f"lognormal:CV expected a number, got {arg!r}") from None
        return lognormal(mean, cv, group_size, cap, seed=seed)
    if kind == "run" and arg:
        return from_run(arg, group_size)
    raise ValueError(f"a length distribution is fixed, lognormal:CV or run:RUN_DIR, not {spec!r}")
