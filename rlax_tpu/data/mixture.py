"""Weighted prompt mixture over datasets, with epochs and exactly restorable state.

Each draw picks a dataset with probability proportional to its weight, then takes the next problem of
that dataset's current epoch (a fresh seeded permutation per epoch). The state (RNG, cursors, epoch
counters, per-prompt ordinals) is a JSON-able dict: :meth:`PromptMixture.state` /
:meth:`PromptMixture.restore` reproduce the same sequence of future prompts exactly, which is what the
controller snapshots.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRef:
    """One issued prompt. ``ordinal`` counts earlier issues of the same prompt (0 for the first)."""

    dataset: str
    index: int  # position of the problem in its dataset
    problem_id: str
    epoch: int
    ordinal: int
    retry: int = 0  # re-issues of this prompt issue after a discard (0: the original)

    @property
    def key(self) -> str:
        """Unique and stable name of this issue of the prompt (ledger key, RNG stream name)."""
        base = f"{self.dataset}/{self.problem_id}#{self.ordinal}"
        return f"{base}~{self.retry}" if self.retry else base


def stream_seed(root_seed: int, *names: str | int) -> int:
    """A 64-bit seed derived from a root seed and names (stable across processes and runs)."""
    text = "/".join([str(root_seed), *map(str, names)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class PromptMixture:
    """Draws prompts from several datasets by weight. Not thread-safe: the controller owns it."""

    def __init__(
        self, datasets: Mapping[str, Sequence[str]], weights: Mapping[str, float], seed: int
    ):
        """``datasets`` maps a dataset name to its problem ids (in dataset order)."""
        if not datasets:
            raise ValueError("the mixture needs at least one dataset")
        if set(datasets) != set(weights):
            raise ValueError(
                f"weights {sorted(weights)} must name exactly the datasets {sorted(datasets)}"
            )
        for name, ids in datasets.items():
            if len(ids) == 0:
                raise ValueError(f"dataset {name!r} is empty")
            if len(set(ids)) != len(ids):
                raise ValueError(f"dataset {name!r} has duplicate problem ids")
            if not weights[name] > 0:
                raise ValueError(
                    f"dataset {name!r} has weight {weights[name]}; weights must be > 0"
                )
        self._names = sorted(datasets)
        self._ids = {n: list(datasets[n]) for n in self._names}
        w = np.array([weights[n] for n in self._names], dtype=np.float64)
        self._probs = w / w.sum()
        self._seed = seed
        self._rng = np.random.Generator(np.random.PCG64(stream_seed(seed, "mixture")))
        self._epoch = {n: 0 for n in self._names}
        self._cursor = {n: 0 for n in self._names}
        self._ordinals: dict[str, int] = {}
        self._issued = 0

    @property
    def issued(self) -> int:
        return self._issued

    def _order(self, name: str, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(stream_seed(self._seed, "epoch", name, epoch)))
        return rng.permutation(len(self._ids[name]))

    def next(self) -> PromptRef:
        name = self._names[int(self._rng.choice(len(self._names), p=self._probs))]
        if self._cursor[name] == len(self._ids[name]):
            self._epoch[name] += 1
            self._cursor[name] = 0
        index = int(self._order(name, self._epoch[name])[self._cursor[name]])
        self._cursor[name] += 1
        pid = self._ids[name][index]
        key = f"{name}/{pid}"
        ordinal = self._ordinals.get(key, 0)
        self._ordinals[key] = ordinal + 1
        self._issued += 1
        return PromptRef(
            dataset=name, index=index, problem_id=pid, epoch=self._epoch[name], ordinal=ordinal
        )

    def take(self, n: int) -> list[PromptRef]:
        return [self.next() for _ in range(n)]

    def state(self) -> dict[str, Any]:
        """JSON-able state; :meth:`restore` continues the exact same sequence."""
        return {
            "seed": self._seed,
            "datasets": {n: len(self._ids[n]) for n in self._names},
            "rng": self._rng.bit_generator.state,
            "epoch": dict(self._epoch),
            "cursor": dict(self._cursor),
            "ordinals": dict(self._ordinals),
            "issued": self._issued,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        sizes = {n: len(self._ids[n]) for n in self._names}
        if state["seed"] != self._seed or state["datasets"] != sizes:
            raise ValueError(
                f"mixture state is for seed {state['seed']} and datasets {state['datasets']}, "
                f"but this mixture has seed {self._seed} and datasets {sizes}"
            )
        self._rng.bit_generator.state = state["rng"]
        self._epoch = dict(state["epoch"])
        self._cursor = dict(state["cursor"])
        self._ordinals = dict(state["ordinals"])
        self._issued = int(state["issued"])


def shard(refs: Sequence[PromptRef], worker: int, num_workers: int) -> list[PromptRef]:
    """The prompts of ``refs`` that worker ``worker`` of ``num_workers`` handles (round robin)."""
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is not in [0, {num_workers})")
    return [r for i, r in enumerate(refs) if i % num_workers == worker]
