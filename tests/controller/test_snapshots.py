from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from rlax_tpu.controller.snapshots import SnapshotError, SnapshotStore


def payload(step: int) -> dict:
    return {
        "step": step,
        "mixture": {"rng": {"state": 2**63 + step}},
        "ledger": [{"key": "a#0", "version": -1}],
        "array": np.arange(4, dtype=np.int32) * step,
        "name": "x",
        "none": None,
    }


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


def test_the_ledger_log_keeps_what_snapshots_cover(tmp_path: Path):
    from rlax_tpu.controller.snapshots import LEDGER_DIR, LedgerLog, full_ledger

    log = LedgerLog(tmp_path / LEDGER_DIR)
    log.write(0, [{"key": "a#0", "state": "trained"}])
    log.write(1, [{"key": "b#0", "state": "discarded"}])
    log.write(2, [{"key": "c#0", "state": "trained"}])  # written by a process that then died
    payload = {"ledger_segments": 2, "ledger": [{"key": "d#0", "state": "buffered"}]}
    assert [r["key"] for r in full_ledger(tmp_path, payload)] == ["a#0", "b#0", "d#0"]
    log.truncate(2)  # what a resume from that snapshot does
    assert log.indices() == [0, 1]


def test_a_buffered_group_round_trips_through_its_array_form():
    from rlax_tpu.controller.groups import GroupResult
    from rlax_tpu.data.mixture import PromptRef
    from rlax_tpu.types import FinishReason, Rollout

    rng = np.random.default_rng(0)
    rollouts = [
        Rollout(
            prompt_id="d/p#0",
            sample_index=i,
            prompt_tokens=np.arange(5, dtype=np.int32),
            tokens=rng.integers(0, 99, n).astype(np.int32),
            logprobs=rng.normal(size=n).astype(np.float32),
            versions=np.full(n, 3, np.int64),
            finish_reason=FinishReason.EOS,
            # The last is a multi-turn episode: tokens 2..4 are the environment's.
            sampled=np.arange(n) % 5 < 2 if i == 2 else None,
            # A MoE model's experts (2 layers, top 3) of every position; none on rollout 1.
            routes=None if i == 1 else rng.integers(-1, 8, (5 + n, 2, 3)).astype(np.int16),
        )
        for i, n in enumerate((4, 0, 7))
    ]
    group = GroupResult(
        ref=PromptRef(dataset="d", index=1, problem_id="p", epoch=0, ordinal=0),
        rollouts=rollouts,
        rewards=np.array([1.0, np.nan, 0.0]),
        verdicts=["accepted", "x", "y"],
        issued_version=2,
    )
    meta, arrays = group.split_state()
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    assert "tokens" not in str(meta)  # no array inside the JSON part
    # Both forms: the arrays snapshots write now, and the JSON one older snapshots hold.
    for back in (GroupResult.from_split(meta, arrays), GroupResult.from_state(group.state())):
        assert back.ref == group.ref and back.verdicts == group.verdicts
        assert back.issued_version == 2
        np.testing.assert_array_equal(back.rewards, group.rewards)
        for a, b in zip(back.rollouts, rollouts, strict=True):
            assert a.prompt_id == b.prompt_id and a.sample_index == b.sample_index
            assert a.finish_reason is b.finish_reason and a.logprob_policy == b.logprob_policy
            for k in ("prompt_tokens", "tokens", "logprobs", "versions"):
                np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
                assert getattr(a, k).dtype == getattr(b, k).dtype
            assert (a.routes is None) == (b.routes is None)
            if b.routes is not None:
                assert a.routes.dtype == np.int16
                np.testing.assert_array_equal(a.routes, b.routes)
            assert (a.sampled is None) == (b.sampled is None)
            if b.sampled is not None:
                assert a.sampled.dtype == bool
                np.testing.assert_array_equal(a.sampled, b.sampled)
    # Single-turn groups keep the layout snapshots had before episodes existed.
    single = GroupResult(
        **{
            **group.__dict__,
            "rollouts": [dataclasses.replace(r, routes=None) for r in rollouts[:2]],
        }
    )
    assert "sampled" not in single.split_state()[1]
    assert "sampled" not in str(single.state())
