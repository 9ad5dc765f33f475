"""The ledger of prompt groups: the controller's record of what is trained, in flight or buffered.

A group (one prompt issue, G samples) moves through

    issued → in_flight → buffered → trained
                 │            │
                 └──────┬─────┘
                        ▼
                    discarded (too stale or filtered) → its prompt is re-issued as a new group

Every transition is checked, so a group is never trained twice and never silently lost: at any time
each group is in exactly one state, and a discarded group names the group that replaced it (if any).
The ledger is plain data and goes into every snapshot.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Iterable
from typing import Any


class GroupState(enum.Enum):
    ISSUED = "issued"  # assigned to a step / queued, generation not started
    IN_FLIGHT = "in_flight"  # generating or verifying
    BUFFERED = "buffered"  # finished and verified, waiting for the trainer
    TRAINED = "trained"  # consumed by an update
    DISCARDED = "discarded"  # dropped (too stale, filtered); see reason


_ALLOWED = {
    GroupState.ISSUED: {GroupState.IN_FLIGHT, GroupState.DISCARDED},
    GroupState.IN_FLIGHT: {GroupState.BUFFERED, GroupState.ISSUED, GroupState.DISCARDED},
    GroupState.BUFFERED: {GroupState.TRAINED, GroupState.DISCARDED},
    GroupState.TRAINED: set(),
    GroupState.DISCARDED: set(),
}


class LedgerError(RuntimeError):
    """An impossible transition: a bug in the controller, never a user error."""


@dataclasses.dataclass
class GroupRecord:
    key: str  # PromptRef.key of the issue
    state: GroupState
    step: int = -1  # training step the group is assigned to (deterministic mode), -1 if none
    version: int = -1  # weight version that generated it, -1 until generated
    trained_at: int = -1  # version of the update that consumed it
    reason: str = ""  # why it was discarded
    replaced_by: str = ""  # key of the re-issue after a discard


class Ledger:
    def __init__(self) -> None:
        self._groups: dict[str, GroupRecord] = {}
        self._closed: list[str] = []  # keys that reached a final state since take_closed()

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, key: str) -> GroupRecord:
        return self._groups[key]

    def issue(self, key: str, *, step: int = -1) -> None:
        if key in self._groups:
            raise LedgerError(f"group {key!r} issued twice")
        self._groups[key] = GroupRecord(key=key, state=GroupState.ISSUED, step=step)

    def _move(self, key: str, to: GroupState) -> GroupRecord:
        if key not in self._groups:
            raise LedgerError(f"unknown group {key!r}")
        rec = self._groups[key]
        if to not in _ALLOWED[rec.state]:
            raise LedgerError(f"group {key!r}: {rec.state.value} -> {to.value} is not allowed")
        rec.state = to
        if to in (GroupState.TRAINED, GroupState.DISCARDED):
            self._closed.append(key)
        return rec

    def start(self, key: str) -> None:
        self._move(key, GroupState.IN_FLIGHT)

    def requeue(self, key: str) -> None:
        """An aborted generation (weight reload, worker loss) goes back to ISSUED."""
        self._move(key, GroupState.ISSUED)

    def finish(self, key: str, *, version: int) -> None:
        self._move(key, GroupState.BUFFERED).version = version

    def train(self, key: str, *, at_version: int) -> None:
        self._move(key, GroupState.TRAINED).trained_at = at_version

    def discard(self, key: str, *, reason: str, replaced_by: str = "") -> None:
        rec = self._move(key, GroupState.DISCARDED)
        rec.reason, rec.replaced_by = reason, replaced_by

    def keys(self, state: GroupState) -> list[str]:
        return [k for k, r in self._groups.items() if r.state is state]

    def counts(self) -> dict[str, int]:
        c = Counter(r.state.value for r in self._groups.values())
        return {s.value: c.get(s.value, 0) for s in GroupState}

    def unfinished(self) -> list[str]:
        """Groups a resumed run must (re-)issue: issued or in flight (their generation is lost)."""
        return [
            k
            for k, r in self._groups.items()
            if r.state in (GroupState.ISSUED, GroupState.IN_FLIGHT)
        ]

    def check(self, prompts_issued: Iterable[str]) -> None:
        """Every issued prompt key is in the ledger, and every discard without a trained copy was
        re-issued; raises LedgerError otherwise."""
        missing = [k for k in prompts_issued if k not in self._groups]
        if missing:
            raise LedgerError(
                f"{len(missing)} issued groups missing from the ledger, e.g. {missing[0]!r}"
            )
        for r in self._groups.values():
            if (
                r.state is GroupState.DISCARDED
                and r.replaced_by
                and r.replaced_by not in self._groups
            ):
                raise LedgerError(
                    f"group {r.key!r} was replaced by unknown group {r.replaced_by!r}"
                )

    def state(self) -> list[dict[str, Any]]:
        return [_row(r) for r in self._groups.values()]

    def live_state(self) -> list[dict[str, Any]]:
        """Rows of the groups not in a final state (what a resumed run still acts on)."""
        final = (GroupState.TRAINED, GroupState.DISCARDED)
        return [_row(r) for r in self._groups.values() if r.state not in final]

    def take_closed(self) -> list[dict[str, Any]]:
        """Rows of the groups that reached a final state since the last call (each once)."""
        rows = [_row(self._groups[k]) for k in self._closed]
        self._closed = []
        return rows

    @classmethod
    def from_state(cls, rows: Iterable[dict[str, Any]]) -> Ledger:
        ledger = cls()
        for row in rows:
            rec = GroupRecord(**(row | {"state": GroupState(row["state"])}))
            ledger._groups[rec.key] = rec
        return ledger


def _row(r: GroupRecord) -> dict[str, Any]:
    return dataclasses.asdict(r) | {"state": r.state.value}
