"""A version number always means the same bytes: once used, it is never published again with
other content, also after it was collected and after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import errors
from tests.param_server.conftest import assert_same_tree, make_tree, running

REUSED = "version 0 is not held and is not newer than version 2, the newest"


def hot(ps) -> list[int]:
    return [v.version for v in ps.client.list_versions()[0]]


def test_a_collected_version_number_cannot_be_published_again():
    with running(ParamServerConfig(in_memory_versions=2, persist_every=0)) as ps:
        for v in range(3):
            ps.client.push(make_tree(v), v)
        assert hot(ps) == [1, 2]  # version 0 was collected
        with pytest.raises(errors.FailedPrecondition, match=REUSED):
            ps.client.push(make_tree(9), 0)  # other content under a used number
        with pytest.raises(errors.FailedPrecondition, match="publish version 3 or later"):
            ps.client.push(make_tree(0), 0)  # same content, but its bytes are gone: unverifiable
        ps.client.push(make_tree(1), 1)  # a hot version: an identical retry stays idempotent
        with pytest.raises(errors.AlreadyExists, match="different content"):
            ps.client.push(make_tree(7), 1)
        assert hot(ps) == [1, 2]
        committed, stored = ps.store.stored_prefixes()
        assert committed == stored and len(committed) == 2
        ps.client.push(make_tree(3), 3)
        assert hot(ps) == [2, 3]
        assert_same_tree(ps.client.pull(3), make_tree(3))


def test_the_high_water_mark_survives_a_restart(tmp_path: Path):
    location = str(tmp_path / "ps")
    config = ParamServerConfig(persist_every=1, persist_keep=2)
    with running(config, location) as ps:
        for v in range(3):
            ps.client.push(make_tree(v), v)
            assert ps.store.flush(timeout_s=60)
    with running(config, location) as ps:
        assert hot(ps) == [1, 2]  # both persisted versions (persist_keep 2)
        with pytest.raises(errors.FailedPrecondition, match=REUSED):
            ps.client.push(make_tree(9), 0)  # collected, and deleted from disk by persist_keep
        assert ps.client.push(make_tree(1), 1).version == 1  # recovered ones: idempotent
        assert ps.client.push(make_tree(2), 2).version == 2
        ps.client.push(make_tree(3), 3)
        assert hot(ps)[-2:] == [2, 3]


def test_a_version_torn_by_a_crash_is_taken_again_only_with_its_content(tmp_path: Path):
    """A server killed while persisting version 3 leaves its arrays and intent record but no
    commit marker: after the restart 3 is not served, and a republish of 3 is taken only with
    the checksums the intent recorded (a deterministic redo), never other bytes."""
    location = str(tmp_path / "ps")
    config = ParamServerConfig(persist_every=1, persist_keep=3)
    with running(config, location) as ps:
        for v in range(4):
            ps.client.push(make_tree(v), v)
            assert ps.store.flush(timeout_s=60)
    marker = Path(location) / "v000000000003" / "manifest.json"
    assert (marker.parent / "intent.json").is_file()
    marker.unlink()  # as a SIGKILL between the arrays and the commit marker leaves it
    with running(config, location) as ps:
        assert hot(ps) == [1, 2]  # 0 was pruned when 3 was persisted (persist_keep 3)
        with pytest.raises(errors.FailedPrecondition, match="differs from the version 3"):
            ps.client.push(make_tree(9), 3)
        assert ps.client.push(make_tree(3), 3).version == 3
        assert_same_tree(ps.client.pull(3), make_tree(3))
        with pytest.raises(errors.FailedPrecondition, match="not newer than version 3"):
            ps.client.push(make_tree(9), 0)
