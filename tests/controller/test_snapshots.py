from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from rlax_tpu.controller.snapshots import SnapshotError, SnapshotStore


def payload(step: int) -> dict:
    return {"step": step, "mixture": {"rng": {"state": 2**63 + step}}, "ledger": [{"key": "a#0", "version": -1}],
            "array": np.arange(4, dtype=np.int32) * step, "name": "x", "none": None}  # fmt: skip


def test_save_load_and_keep_newest(tmp_path: Path):
    store = SnapshotStore(tmp_path, keep=2)
    for step in range(4):
        store.save(step, payload(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "snapshot_000000002.msgpack",
        "snapshot_000000003.msgpack",
    ]
    step, data = store.latest()
    assert step == 3 and data["mixture"]["rng"]["state"] == 2**63 + 3 and data["none"] is None
    np.testing.assert_array_equal(data["array"], np.arange(4) * 3)


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_corrupt_newest_is_skipped_with_a_warning(tmp_path: Path, caplog, damage):
    store = SnapshotStore(tmp_path, keep=3)
    store.save(1, payload(1))
    path = store.save(2, payload(2))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-3] ^= 0xFF
    else:
        data[:5] = b"XXXXX"
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        step, restored = store.latest()
    assert step == 1 and restored["step"] == 1
    assert "skipping unreadable snapshot" in caplog.text and "snapshot_000000002" in caplog.text
    with pytest.raises(SnapshotError):
        store.load(2)


def test_empty_directory_and_stray_files(tmp_path: Path):
    store = SnapshotStore(tmp_path / "missing", keep=1)
    assert store.latest() is None
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".snapshot_000000009.msgpack.abc.tmp").write_bytes(b"partial")  # a crashed write
    assert SnapshotStore(tmp_path, keep=1).latest() is None
