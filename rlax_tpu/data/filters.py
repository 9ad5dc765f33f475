"""Curation (RLAX §6.2): keep prompts the current policy solves sometimes, and count what is dropped."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreFilterResult:
    kept: tuple[str, ...]
    dropped_solved: tuple[str, ...]  # pass rate above the upper bound: nothing to learn
    dropped_unsolved: tuple[str, ...]  # pass rate below the lower bound: no signal

    @property
    def dropped(self) -> int:
        return len(self.dropped_solved) + len(self.dropped_unsolved)


def prefilter(
    pass_rates: Mapping[str, float], *, low: float = 0.0, high: float = 1.0
) -> PreFilterResult:
    """Keeps prompts whose estimated pass rate r satisfies low < r < high (partially solved).

    ``pass_rates`` maps a prompt id to the fraction of the policy's samples that passed.
    """
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}")
    kept, solved, unsolved = [], [], []
    for pid, rate in pass_rates.items():
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"pass rate of {pid!r} is {rate}, not in [0, 1]")
        if rate >= high:
            solved.append(pid)
        elif rate <= low:
            unsolved.append(pid)
        else:
            kept.append(pid)
    return PreFilterResult(
        kept=tuple(kept), dropped_solved=tuple(solved), dropped_unsolved=tuple(unsolved)
    )
