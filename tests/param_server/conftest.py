"""Real parameter servers on 127.0.0.1 and seeded test trees."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.server import ParamServer
from rlax_tpu.param_server.service import serve


@dataclasses.dataclass
class Running:
    endpoint: str
    store: ParamServer
    client: ParamServerClient


@contextlib.contextmanager
def running(config: ParamServerConfig, persist_location: str = "") -> Iterator[Running]:
    server, port, store = serve(config, persist_location=persist_location)
    endpoint = f"127.0.0.1:{port}"
    client = ParamServerClient(endpoint, chunk_bytes=config.chunk_bytes, timeout_s=60)
    try:
        yield Running(endpoint, store, client)
    finally:
        client.close()
        server.stop(None)
        store.close()


class Replica:
    """Replica ``index`` of a set, which a test can stop and start again on the same port."""

    def __init__(self, config: ParamServerConfig, persist_location: str = ""):
        self.config, self.persist_location = config, persist_location
        self.server, self.port, self.store = serve(config, persist_location=persist_location)
        self.endpoint = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(None).wait()
        self.store.close()
        self.server = None

    def start(self) -> None:
        config = dataclasses.replace(self.config, address=self.endpoint)
        self.server, _, self.store = serve(config, persist_location=self.persist_location)

    def hot(self) -> list[int]:
        return [v.version for v in self.store.list_versions()]


@contextlib.contextmanager
def replicas(n: int, persist_root: str = "", **fields: object) -> Iterator[list[Replica]]:
    made: list[Replica] = []
    try:
        for r in range(n):
            config = ParamServerConfig(
                replicas=n, replica_index=r, chunk_bytes=1000, persist_every=0, **fields
            )
            if persist_root:
                config = dataclasses.replace(config, persist_every=1)
            made.append(Replica(config, f"{persist_root}/replica-{r}" if persist_root else ""))
        yield made
    finally:
        for replica in made:
            if replica.server is not None:
                replica.stop()


@pytest.fixture
def ps() -> Iterator[Running]:
    """A server with small chunks, so every array spans several messages."""
    with running(ParamServerConfig(chunk_bytes=1000, persist_every=0)) as r:
        yield r


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, -0, infinities, subnormals included)."""
    if dtype == "bfloat16":
        return rng.integers(0, 2**16, shape, dtype=np.uint16).view(ml_dtypes.bfloat16)
    return rng.integers(0, 2**32, shape, dtype=np.uint32).view(np.float32)


def make_tree(seed: int = 0, *, scale: int = 1) -> dict:
    """A small model-like tree mixing float32 and bfloat16 leaves."""
    rng = np.random.default_rng(seed)
    return {
        "embed": random_bits(rng, (64 * scale, 16), "bfloat16"),
        "layers": [
            {
                "wq": random_bits(rng, (16, 32), "float32"),
                "norm": random_bits(rng, (16,), "float32"),
            },
            {
                "wq": random_bits(rng, (16, 32), "float32"),
                "norm": random_bits(rng, (16,), "float32"),
            },
        ],
        "head": random_bits(rng, (16, 64 * scale), "bfloat16"),
    }


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_tree(got: dict, want: dict) -> None:
    import jax

    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert same_bits(g, w)


def assert_lands_sharded(got: dict, shardings: dict, want: dict) -> None:
    """Every array of ``got`` has its sharding in ``shardings`` and each of its shards holds
    ``want``'s bits at the shard's index."""
    import jax

    for x, s, w in zip(
        jax.tree_util.tree_leaves(got),
        jax.tree_util.tree_leaves(shardings),
        jax.tree_util.tree_leaves(want),
        strict=True,
    ):
        assert x.sharding == s
        for shard in x.addressable_shards:
            assert same_bits(np.asarray(shard.data), w[shard.index])
