"""The path layer (rlax_tpu/storage.py) on local files and on gs:// served by a real GCS server
on 127.0.0.1 (the emulator fixture): every reader and writer of a run's files goes through it."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

from rlax_tpu import storage

from .conftest import GCS_BUCKET


@pytest.fixture
def gs(gcs_emulator) -> str:
    """A fresh gs:// folder on the emulator."""
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:8]}"


def test_local_paths_are_absolute_and_gs_kept_intact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(storage.path("runs/a")) == str(tmp_path / "runs" / "a")
    assert os.fspath(storage.path("gs://b/x//y")).startswith("gs://b/")
    # pathlib would fold gs:// into gs:/ (how the v5p preset once made a local ./gs: folder).
    assert storage.join("gs://b/runs", "trainer") == "gs://b/runs/trainer"
    assert storage.is_remote("gs://b") and not storage.is_remote(tmp_path)


@pytest.mark.parametrize("where", ["local", "gs"])
def test_write_atomic_read_back_and_list(where, tmp_path, request):
    base = str(tmp_path) if where == "local" else request.getfixturevalue("gs")
    target = storage.path(base) / "sub" / "a.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    storage.write_atomic(target, json.dumps({"v": 1}))
    storage.write_atomic(target, json.dumps({"v": 2}))  # replaced whole
    assert json.loads(target.read_text()) == {"v": 2}
    assert [p.name for p in (storage.path(base) / "sub").iterdir()] == ["a.json"]  # no temp left


def test_local_copy_of_a_gs_folder(gs, tmp_path, monkeypatch):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    src = storage.path(gs) / "weights"
    (src / "nested").mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text("{}")
    (src / "nested" / "w.bin").write_bytes(bytes(range(256)) * 10)
    local = storage.local_copy(src)
    assert local.is_relative_to(tmp_path / "cache")
    assert (local / "config.json").read_text() == "{}"
    assert (local / "nested" / "w.bin").read_bytes() == bytes(range(256)) * 10
    # A changed file is fetched again; an unchanged one is not rewritten.
    (src / "config.json").write_text('{"a": 1}')
    before = (local / "nested" / "w.bin").stat().st_mtime_ns
    assert (storage.local_copy(src) / "config.json").read_text() == '{"a": 1}'
    assert (local / "nested" / "w.bin").stat().st_mtime_ns == before
    with pytest.raises(FileNotFoundError):
        storage.local_copy(f"{gs}/missing")


def test_tensorstore_and_gcsfs_see_one_bucket(gs):
    """What Orbax and the parameter server write through TensorStore's GCS driver is what
    gcsfs lists (both pointed at the emulator)."""
    import tensorstore as ts

    arr = ts.open(
        {"driver": "zarr3", "kvstore": f"{gs}/arr/"}, create=True, dtype=ts.float32, shape=[5]
    ).result()
    arr.write(np.arange(5, dtype=np.float32)).result()
    assert (storage.path(gs) / "arr" / "zarr.json").exists()
    again = ts.open({"driver": "zarr3", "kvstore": f"{gs}/arr/"}).result()
    np.testing.assert_array_equal(again.read().result(), np.arange(5, dtype=np.float32))


def test_an_ocdbt_manifest_is_updated_in_place(gs):
    """Orbax's OCDBT checkpoints update their manifest with a conditional write on the
    generation read back: the server must report generations as GCS does (tests/gcs_server.py)."""
    import tensorstore as ts

    for i in range(3):
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"{gs}/db/"}).result()
        kv.write(f"k{i}", b"v").result()
    assert kv.list().result() == [b"k0", b"k1", b"k2"]


def test_a_key_range_is_deleted_and_nothing_beside_it(gs):
    """TensorStore's delete_range lists [start, end) on GCS (the parameter server deletes one
    persisted version that way): its neighbours stay."""
    import tensorstore as ts

    kv = ts.KvStore.open(f"{gs}/kv/").result()
    for key in ("v1/a", "v2/a", "v2/b", "v3/a"):
        kv.write(key, b"x").result()
    kv.delete_range(ts.KvStore.KeyRange("v2/", "v20")).result()
    assert kv.list().result() == [b"v1/a", b"v3/a"]
