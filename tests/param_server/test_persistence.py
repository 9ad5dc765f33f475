"""Write-through to a file kvstore and recovery after a restart; partial copies are never taken."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.codec import ArraySpec
from rlax_tpu.param_server.store import ArrayStore
from tests.param_server.conftest import assert_same_tree, make_tree, running

# Keeps 3 persisted versions: publish_five's 0, 2 and 4 all stay, for the fallback tests.
CONFIG = ParamServerConfig(persist_every=2, in_memory_versions=4, persist_keep=3)


def publish_five(location: str) -> None:
    with running(CONFIG, location) as ps:
        for v in range(5):
            ps.client.push(make_tree(v), v)
        assert ps.store.flush(timeout_s=60)
        persisted = {v.version for v in ps.client.list_versions()[0] if v.persisted}
        # Version 0 may be collected already, or kept while its write-through was running.
        assert persisted in ({2, 4}, {0, 2, 4})


def recovered(location: str) -> tuple[list[int], dict | None]:
    with running(CONFIG, location) as ps:
        versions = [v.version for v in ps.client.list_versions()[0]]
        return versions, ps.client.pull() if versions else None


def test_restart_serves_the_newest_persisted_version(tmp_path: Path):
    location = str(tmp_path / "ps")
    publish_five(location)
    # Every 2nd version was written through (3 of them, all within persist_keep); the new server
    # serves them all (a resumed controller may need older ones), the newest as the latest.
    assert sorted(p.name for p in Path(location).iterdir()) == [
        "v000000000000",
        "v000000000002",
        "v000000000004",
    ]
    versions, tree = recovered(location)
    assert versions == [0, 2, 4]
    assert_same_tree(tree, make_tree(4))
    with running(CONFIG, location) as ps:
        assert_same_tree(ps.client.pull(2), make_tree(2))
        # It keeps serving: the trainer publishes the next version on top.
        ps.client.push(make_tree(5), 5)
        assert [v.version for v in ps.client.list_versions()[0]][-2:] == [4, 5]


def test_a_version_without_its_commit_marker_is_not_taken(tmp_path: Path):
    location = str(tmp_path / "ps")
    publish_five(location)
    (Path(location) / "v000000000004" / "manifest.json").unlink()  # died before the marker
    versions, tree = recovered(location)
    assert versions == [0, 2]
    assert_same_tree(tree, make_tree(2))


def test_a_corrupted_or_torn_version_is_not_taken(tmp_path: Path):
    location = str(tmp_path / "ps")
    publish_five(location)
    chunk = next(p for p in (Path(location) / "v000000000004").rglob("c/*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    chunk.write_bytes(bytes(data))
    torn = next(p for p in (Path(location) / "v000000000002").rglob("c/*") if p.is_file())
    torn.write_bytes(torn.read_bytes()[:7])  # a half-written chunk
    versions, tree = recovered(location)
    assert versions == [0]
    assert_same_tree(tree, make_tree(0))


def test_nothing_persisted_means_an_empty_server(tmp_path: Path):
    versions, _ = recovered(str(tmp_path / "empty"))
    assert versions == []


def test_only_the_newest_persist_keep_versions_stay_on_disk(tmp_path: Path):
    location = tmp_path / "ps"
    location.mkdir()
    (location / "notes.txt").write_text("not ours")
    config = ParamServerConfig(persist_every=2, in_memory_versions=4, persist_keep=2)
    with running(config, str(location)) as ps:
        for v in range(7):  # persists 0, 2, 4, 6
            ps.client.push(make_tree(v), v)
            assert ps.store.flush(timeout_s=60)  # a version being persisted cannot be collected
            if v == 2:  # debris, as a crash would leave it: a torn copy without its manifest
                (location / "v000000000003" / "a0").mkdir(parents=True)
                (location / "v000000000003" / "a0" / "zarr.json").write_text("{")
        assert sorted(p.name for p in location.iterdir()) == [
            "notes.txt",
            "v000000000004",
            "v000000000006",
        ]
        listed = ps.client.list_versions()[0]
        assert [(v.version, v.persisted) for v in listed] == [
            (3, False),
            (4, True),
            (5, False),
            (6, True),
        ]
    versions, tree = recovered(str(location))  # the newest complete one is never deleted
    assert versions == [4, 6]
    assert_same_tree(tree, make_tree(6))


def test_health_reports_failing_persistence_until_a_write_succeeds(tmp_path: Path):
    location = tmp_path / "ps"
    config = ParamServerConfig(persist_every=1, persist_keep=2)
    with running(config, str(location)) as ps:
        ps.client.push(make_tree(0), 0)
        assert ps.store.flush(timeout_s=60)
        assert ps.client.health()[0].serving
        shutil.rmtree(location)
        location.write_text("a file where the directory was: every write fails")
        ps.client.push(make_tree(1), 1)  # the push itself succeeds; its write-through does not
        assert ps.store.flush(timeout_s=60)
        health = ps.client.health()[0]
        assert not health.serving
        assert "persistence is failing: persisting version 1 to" in health.detail
        location.unlink()
        ps.client.push(make_tree(2), 2)
        assert ps.store.flush(timeout_s=60)
        health = ps.client.health()[0]
        assert health.serving and "failing" not in health.detail


def to_legacy(manifest_path: Path, *, corrupt: bool = False) -> None:
    """Rewrites a persisted manifest as written before CRC32C: zlib crc32 under "crc32"."""
    raw = json.loads(manifest_path.read_text())
    store = ArrayStore(str(manifest_path.parent.parent))
    del raw["checksum"]
    for i, a in enumerate(raw["arrays"]):
        spec = ArraySpec(path=a["path"], shape=tuple(a["shape"]), dtype=a["dtype"])
        data = store.read_array(manifest_path.parent.name, i, spec).result()
        del a["crc32c"]
        a["crc32"] = zlib.crc32(data.tobytes()) ^ (1 if corrupt and i == 0 else 0)
    manifest_path.write_text(json.dumps(raw))


def test_versions_persisted_with_zlib_crc32_still_recover(tmp_path: Path):
    location = tmp_path / "ps"
    publish_five(str(location))
    to_legacy(location / "v000000000004" / "manifest.json", corrupt=True)
    to_legacy(location / "v000000000002" / "manifest.json")
    versions, tree = recovered(str(location))  # 4 fails its (legacy) check; 2 passes it
    assert versions == [0, 2]
    assert_same_tree(tree, make_tree(2))  # pull_arrays checked the re-computed CRC32C


def test_persistence_on_gs_survives_a_restart(gcs_emulator):
    """The same write-through and recovery with persist_path on gs:// (a GCS server on
    127.0.0.1, TensorStore's GCS driver)."""
    import uuid

    from rlax_tpu import storage
    from tests.conftest import GCS_BUCKET

    location = f"gs://{GCS_BUCKET}/ps-{uuid.uuid4().hex[:8]}"
    publish_five(location)
    assert {p.name for p in storage.path(location).iterdir()} >= {"v000000000002", "v000000000004"}
    versions, tree = recovered(location)
    assert versions[-2:] == [2, 4]
    assert_same_tree(tree, make_tree(4))
