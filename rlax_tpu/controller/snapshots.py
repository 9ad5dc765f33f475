"""Controller snapshots: atomic, checksummed, newest K kept, on a local dir or ``gs://``.

A snapshot is one file ``snapshot_<step:09d>.msgpack``: a magic line, the SHA-256 of the payload, then
the payload (msgpack of plain dicts/lists/scalars/numpy arrays). It is written with
``storage.write_atomic`` (a temporary file renamed on a local filesystem, one object upload on GCS),
so a reader sees a complete file or none. A file that is truncated or fails its checksum is skipped with a warning and the
previous snapshot is used. Paths go through ``rlax_tpu.storage`` so local and GCS share one code path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

from etils import epath
from flax import serialization

from rlax_tpu import storage

MAGIC = b"rlax_tpu-snapshot-v1\n"
_NAME = re.compile(r"^snapshot_(\d{9})\.msgpack$")
log = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """A snapshot file is unreadable: truncated, corrupt, or not a snapshot."""


def _encode(payload: dict[str, Any]) -> bytes:
    body = serialization.msgpack_serialize(payload)
    return MAGIC + hashlib.sha256(body).digest() + body


def _decode(data: bytes, name: str) -> dict[str, Any]:
    if not data.startswith(MAGIC):
        raise SnapshotError(f"{name}: not a snapshot (bad header)")
    digest, body = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
    if len(digest) != 32 or hashlib.sha256(body).digest() != digest:
        raise SnapshotError(f"{name}: checksum mismatch (truncated or corrupt)")
    try:
        return serialization.msgpack_restore(body)
    except Exception as e:  # msgpack raises several types on garbage
        raise SnapshotError(f"{name}: undecodable payload: {e}") from e


class SnapshotStore:
    def __init__(self, directory: str | epath.Path, *, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = storage.path(directory)
        self.keep = keep

    def _steps(self) -> list[int]:
        if not self.dir.exists():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    def steps(self) -> list[int]:
        """Steps with a snapshot file, oldest first (readable or not)."""
        return self._steps()

    def latest_step(self) -> int | None:
        steps = self._steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> epath.Path:
        return self.dir / f"snapshot_{step:09d}.msgpack"

    def save(self, step: int, payload: dict[str, Any]) -> epath.Path:
        """Writes the snapshot of ``step`` atomically, then deletes all but the newest ``keep``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        # Not a rename on GCS (a copy and a delete there). A resumed run may rewrite the
        # snapshot of its first step.
        storage.write_atomic(final, _encode(payload))
        for old in self._steps()[: -self.keep]:
            self.path(old).unlink(missing_ok=True)
        return final

    def load(self, step: int) -> dict[str, Any]:
        path = self.path(step)
        return _decode(path.read_bytes(), str(path))

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest readable snapshot as (step, payload); corrupt newer ones are skipped, warned."""
        for step in reversed(self._steps()):
            try:
                return step, self.load(step)
            except SnapshotError as e:
                log.warning("skipping unreadable snapshot: %s", e)
        return None


class LedgerLog:
    """The ledger's finished records (trained or discarded groups), out of the snapshots so
    those stay small: one JSON-lines segment per snapshot that closed any group,
    ``<dir>/finished_<index:06d>.jsonl``, written before its snapshot. A snapshot records how
    many segments it covers; a resume deletes later ones (written by the process that died)."""

    def __init__(self, directory: str | epath.Path):
        self.dir = storage.path(directory)

    def _path(self, index: int) -> epath.Path:
        return self.dir / f"finished_{index:06d}.jsonl"

    def indices(self) -> list[int]:
        if not self.dir.exists():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _SEGMENT.match(p.name)))

    def write(self, index: int, rows: list[dict[str, Any]]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(self._path(index), "".join(json.dumps(r) + "\n" for r in rows))

    def truncate(self, count: int) -> None:
        """Deletes segments ``count`` and later."""
        for i in self.indices():
            if i >= count:
                self._path(i).unlink(missing_ok=True)

    def read(self, count: int) -> list[dict[str, Any]]:
        """Rows of segments 0 .. count-1, oldest first."""
        rows = []
        for i in range(count):
            rows += [json.loads(line) for line in self._path(i).read_text().splitlines() if line]
        return rows


_SEGMENT = re.compile(r"^finished_(\d{6})\.jsonl$")
LEDGER_DIR = "ledger"


def full_ledger(run_dir: str | epath.Path, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ledger record of a run as of snapshot ``payload`` (its JSON, parsed): the finished
    ones from the segments it covers, then the ones it holds."""
    count = int(payload.get("ledger_segments", 0))
    return LedgerLog(storage.path(run_dir) / LEDGER_DIR).read(count) + list(payload["ledger"])
