"""The next version fetched while the engine generates (inference/standby.py): the load takes the
staged copy, versions stage in order, failures reach the load, and a staged swap gives the same
samples as a reload that fetched at the load."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest

from rlax_tpu.inference.service import InferenceClient, serve
from rlax_tpu.inference.standby import Standby
from rlax_tpu.inference.worker import DictWeightSource, InferenceWorker, UnknownVersion

from .conftest import SMALL, by_key, random_requests


class Gated:
    """A weight source whose fetches wait for the test (``gate``), recording what was asked."""

    def __init__(self, versions: dict):
        self.inner = DictWeightSource(versions)
        self.asked: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def fetch(self, version: int):
        self.asked.append(version)
        assert self.gate.wait(timeout=60)
        return self.inner.fetch(version)


def test_a_staged_version_is_fetched_once_and_taken_by_its_load():
    source = Gated({1: "one", 2: "two", 3: "three"})
    standby = Standby(source.fetch)
    source.gate.clear()
    standby.stage(1)
    standby.stage(2)  # waits for version 1 to be taken: one fetched copy at a time
    standby.stage(1)  # already staged: nothing more
    assert standby.staged() == 1
    source.gate.set()
    assert standby.take(1) == "one"
    # Until version 1 is swapped in, version 2 is not fetched: the devices hold the served
    # weights and one standby copy at most.
    assert standby.staged() is None and source.asked == [1]
    standby.stage(1)  # at or below the version taken: not staged again
    standby.loaded()
    assert standby.take(2) == "two"
    standby.loaded()
    assert source.asked == [1, 2]
    assert standby.take(3) == "three"  # never staged: fetched at the load
    standby.loaded()
    assert source.asked == [1, 2, 3]
    assert standby.counts == {"staged": 2, "taken_staged": 2, "fetched_at_load": 1}


def test_a_load_past_staged_versions_drops_them():
    source = Gated({1: "one", 2: "two", 3: "three", 4: "four"})
    standby = Standby(source.fetch)
    standby.stage(2)
    standby.stage(1)  # asked out of order
    standby.stage(4)
    assert standby.take(3) == "three"  # 2 (fetched) and 1 (asked) are skipped
    standby.loaded()
    assert standby.take(4) == "four"  # 4 was kept
    assert source.asked.count(1) == 0 and source.asked[-1] == 4


def test_a_failed_staged_fetch_is_tried_again_by_the_load():
    source = Gated({})
    standby = Standby(source.fetch)
    standby.stage(4)  # not published yet
    while standby._slot is not None and not standby._slot.done.is_set():
        standby._slot.done.wait(0.01)
    source.inner.versions[4] = "four"  # published now
    assert standby.take(4) == "four"
    standby.loaded()
    assert source.asked == [4, 4]
    standby.stage(5)
    with pytest.raises(UnknownVersion, match="no weights for version 5"):
        standby.take(5)  # fails again at the load: raised


def _halved(tiny_model, factor: float):
    from flax import nnx

    return jax.tree.map(lambda x: x * factor, nnx.state(tiny_model))


def _run(tiny_model, *, stage: bool) -> tuple[dict, dict, Gated]:
    """Generates a batch at version 0, reloads version 1 (staged while the batch runs, or
    fetched at the load) and generates a second batch."""
    source = Gated({0: _halved(tiny_model, 1.0), 1: _halved(tiny_model, 0.5)})
    worker = InferenceWorker(tiny_model, SMALL, weight_source=source)
    try:
        first = random_requests(4, seed=41, num_samples=2)
        first = [
            dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=20))
            for r in first
        ]
        stream = worker.generate(first, version=0)
        if stage:
            source.gate.clear()
            worker.stage(1)
        before = by_key(stream)  # the batch finishes while the fetch of version 1 waits
        if stage:
            assert source.asked == [1] and worker.standby.staged() == 1
            source.gate.set()
        assert worker.load_weights(1) == 0  # the batch had finished: nothing aborted
        after = by_key(worker.generate(random_requests(4, seed=42, num_samples=2), version=1))
        return before, after, source
    finally:
        worker.shutdown()


def test_a_staged_swap_samples_as_a_reload_that_fetched_at_the_load(tiny_model):
    staged = _run(tiny_model, stage=True)
    fetched = _run(tiny_model, stage=False)
    assert staged[2].asked == fetched[2].asked == [1]  # one fetch of version 1 either way
    for got, want in zip(staged[:2], fetched[:2], strict=True):
        assert got.keys() == want.keys()
        for key, ro in want.items():  # the same programs on the same inputs: bitwise
            np.testing.assert_array_equal(got[key].tokens, ro.tokens)
            np.testing.assert_array_equal(got[key].logprobs, ro.logprobs)
            np.testing.assert_array_equal(got[key].versions, ro.versions)


def test_staging_over_grpc(tiny_model):
    source = Gated({0: _halved(tiny_model, 1.0), 1: _halved(tiny_model, 0.5)})
    worker = InferenceWorker(tiny_model, SMALL, weight_source=source)
    server, port = serve(worker, "127.0.0.1:0")
    client = InferenceClient(f"127.0.0.1:{port}")
    try:
        client.wait_ready(10)
        client.stage(1)
        client.load_weights(1)
        assert client.status().version == 1
        assert worker.standby.counts["staged"] == 1 and source.asked == [1]
        bare = InferenceWorker(tiny_model, SMALL)
        try:
            with pytest.raises(UnknownVersion, match="no weight source"):
                bare.stage(1)
        finally:
            bare.shutdown()
    finally:
        client.close()
        server.stop(None)
        worker.shutdown()
