"""TBA replay (data.replay): the controller's replay buffer of verified rollouts.

Every verified group's rollouts enter a :class:`~rlax_tpu.data.replay.ReplayBuffer` (per-prompt
lists, deduplicated by tokens); each update then trains on ``prompts_per_step`` groups drawn from
it (TBA: a prompt with recent items with probability m, else any prompt with reward-prioritized
items), never older than η_a. The step's own groups enter the buffer at the update that draws.

Persistence without copying the buffer into every snapshot: before each snapshot the items added
since the previous one are written once, as segment ``<run_dir>/replay/added_<i:06d>.msgpack``;
the snapshot holds the buffer's index (each live item's segment and position) and its RNG state. A
resume reads the segments its snapshot names and deletes later ones; a segment no kept snapshot
names is deleted.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath
from flax import serialization

from rlax_tpu import storage
from rlax_tpu.config import DataConfig
from rlax_tpu.controller.groups import GroupResult, join_rollouts, split_rollouts
from rlax_tpu.data.mixture import PromptRef
from rlax_tpu.data.replay import ReplayBuffer, ReplayItem
from rlax_tpu.types import Rollout

REPLAY_DIR = "replay"
_SEGMENT = re.compile(r"^added_(\d{6})\.msgpack$")


@dataclasses.dataclass
class _Stored:
    rollout: Rollout
    ref: PromptRef  # of the group it came from
    where: tuple[int, int] | None = None  # (segment, position) once written


class ReplayFeed:
    def __init__(
        self,
        config: DataConfig,
        *,
        seed: int,
        group_size: int,
        max_staleness: float,
        directory: str | epath.Path,
    ):
        self.buffer = ReplayBuffer(
            per_prompt=config.replay_per_prompt,
            max_items=config.replay_max_items,
            recency_prob=config.replay_recency_prob,
            recent_versions=config.replay_recent_versions,
            priority=config.replay_priority,
            temperature=config.replay_temperature,
            seed=seed,
        )
        self.k, self.max_staleness = group_size, max_staleness
        self.dir = storage.path(directory)
        self.segments = 0  # segments written (the next one's index)
        self._pending: list[_Stored] = []  # added since the last segment
        self._needs: dict[int, set[int]] = {}  # snapshot step -> segments it names

    # -- the update ----------------------------------------------------------------------------
    def add(self, results: Sequence[GroupResult]) -> int:
        """Stores the rollouts of every verified group; returns how many were new."""
        new = 0
        for r in results:
            if r.verifier_failed:
                continue
            for ro, reward in zip(r.rollouts, r.rewards, strict=True):
                if not len(ro.tokens):
                    continue
                stored = _Stored(ro, r.ref)
                item = ReplayItem(
                    prompt_id=_prompt(r.ref),
                    tokens=tuple(int(t) for t in ro.tokens),
                    version=ro.version,
                    reward=float(reward),
                    payload=stored,
                )
                self._pending.append(stored)
                new += int(self.buffer.add(item))
        return new

    def draw(self, n: int, version: int) -> list[GroupResult]:
        """``n`` groups of ``group_size`` rollouts for the update from ``version``."""
        out = []
        for _, items, pool in self.buffer.sample_groups(
            n, self.k, current_version=version, max_staleness=self.max_staleness
        ):
            ref = items[0].payload.ref
            rollouts = [
                dataclasses.replace(it.payload.rollout, sample_index=i)
                for i, it in enumerate(items)
            ]
            out.append(
                GroupResult(
                    ref=dataclasses.replace(ref, ordinal=0, retry=0),
                    rollouts=rollouts,
                    rewards=np.array([it.reward for it in items], np.float64),
                    verdicts=["accepted" if it.reward > 0 else "wrong_answer" for it in items],
                    replayed=pool,
                )
            )
        return out

    # -- snapshots -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Writes the items added since the last flush as the next segment (before a snapshot)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        meta, arrays = split_rollouts([s.rollout for s in pending])
        refs = [dataclasses.asdict(s.ref) for s in pending]
        self.dir.mkdir(parents=True, exist_ok=True)
        body = serialization.msgpack_serialize({"meta": meta, "refs": refs, "arrays": arrays})
        storage.write_atomic(self._path(self.segments), body)
        for i, s in enumerate(pending):
            s.where = (self.segments, i)
        self.segments += 1

    def state(self) -> dict[str, Any]:
        """The buffer's index and RNG state, JSON-able; call after :meth:`flush`."""
        state = self.buffer.state()
        for _, fields in state["items"]:
            fields["payload"] = list(fields["payload"].where)
        return state | {"segments": self.segments}

    def collect(self, step: int, kept_steps: Sequence[int], state: dict[str, Any]) -> None:
        """After the snapshot of ``step`` (holding ``state``) is saved: deletes the segments no
        kept snapshot names. A kept snapshot from before a restart is taken to name every
        segment it covers."""
        self._needs[step] = {f["payload"][0] for _, f in state["items"]}
        self._needs = {s: n for s, n in self._needs.items() if s in kept_steps}
        if any(s not in self._needs for s in kept_steps):
            return  # a snapshot from before a restart may name any segment below its count
        needed: set[int] = set().union(*self._needs.values())
        for i in self._indices():
            if i not in needed and i < self.segments:
                self._path(i).unlink(missing_ok=True)

    def restore(self, state: dict[str, Any]) -> None:
        """Loads the buffer a snapshot names; deletes segments written after it."""
        self.segments = int(state["segments"])
        for i in self._indices():
            if i >= self.segments:
                self._path(i).unlink(missing_ok=True)
        wanted = sorted({f["payload"][0] for _, f in state["items"]})
        loaded = {i: self._read(i) for i in wanted}
        items = []
        for order, fields in state["items"]:
            seg, pos = fields["payload"]
            rollout, ref = loaded[seg][pos]
            items.append((order, fields | {"payload": _Stored(rollout, ref, (seg, pos))}))
        self.buffer.restore(state | {"items": items})
        self._pending = []

    def _read(self, index: int) -> list[tuple[Rollout, PromptRef]]:
        data = serialization.msgpack_restore(self._path(index).read_bytes())
        rollouts = join_rollouts(data["meta"], data["arrays"])
        return [(ro, PromptRef(**ref)) for ro, ref in zip(rollouts, data["refs"], strict=True)]

    def _path(self, index: int) -> epath.Path:
        return self.dir / f"added_{index:06d}.msgpack"

    def _indices(self) -> list[int]:
        if not self.dir.exists():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _SEGMENT.match(p.name)))


def _prompt(ref: PromptRef) -> str:
    return f"{ref.dataset}/{ref.problem_id}"
