"""Readers running while versions are published never see a partial version."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import errors
from tests.param_server.conftest import running

VERSIONS = 12


def filled(version: int) -> dict:
    """Every element of every array equals the version: a mix of two versions shows."""
    return {
        "a": np.full((48, 40), version, np.float32),
        "b": [np.full((40,), version, np.float32), np.full((8, 8, 8), version, np.float32)],
    }


def test_concurrent_readers_never_see_a_partial_version():
    # Small chunks and in_memory_versions=3: each publish is many messages and triggers GC.
    config = ParamServerConfig(chunk_bytes=512, in_memory_versions=3, persist_every=0)
    with running(config) as ps:
        ps.client.push(filled(0), 0)
        done = threading.Event()
        seen: list[list[int]] = [[] for _ in range(3)]
        failures: list[str] = []

        def publisher():
            try:
                v = 1
                while v < VERSIONS:
                    try:
                        ps.client.push(filled(v), v)
                        v += 1
                    except errors.ResourceExhausted:
                        pass  # readers pin every old version right now; try again
            finally:
                done.set()

        def reader(mine: list[int]):
            while not done.is_set() or len(mine) < 3:
                try:
                    manifest, arrays = ps.client.pull_arrays()  # latest
                    listed, _ = ps.client.list_versions()
                    for info in listed:  # every listed version is whole, or already collected
                        try:
                            m, more = ps.client.pull_arrays(info.version)
                        except errors.NotFound:
                            continue
                        check(m.version, more)
                except Exception as e:  # collected in the main thread
                    failures.append(repr(e))
                    return
                check(manifest.version, arrays)
                mine.append(manifest.version)

        def check(version, arrays):
            values = {float(x) for a in arrays for x in np.unique(a)}
            if values != {float(version)}:
                failures.append(f"version {version} holds values {sorted(values)}")

        threads = [threading.Thread(target=publisher)] + [
            threading.Thread(target=reader, args=(mine,)) for mine in seen
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not failures
        for mine in seen:  # "latest" never goes back
            assert len(mine) >= 3 and mine == sorted(mine)
        _, latest = ps.client.list_versions()
        assert latest == VERSIONS - 1
        # Unpublished version numbers are simply not there.
        with pytest.raises(errors.NotFound):
            ps.client.pull_arrays(VERSIONS)
