"""The failure rule for an inference worker over two processes (``python -m rlax_tpu.inference``
twice, one CPU device each, a tensor-2 mesh across them): a version one process cannot fetch is
loaded by neither and the caller is told which; killing one process ends the other, non-zero,
naming the dead one."""

from __future__ import annotations

import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.inference.service import InferenceClient
from rlax_tpu.inference.worker import UnknownVersion
from tests.multihost_job import kill_and_wait, serving_endpoint, start, stop_all

from .conftest import random_requests
from .test_worker import SERVICE_INFERENCE, _local_config


@pytest.mark.slow
def test_a_version_one_process_lacks_is_refused_and_killing_the_follower_ends_the_lead():
    """Each process pulls from its own parameter server; only the lead's has version 1.
    load_weights(1) is refused by both (NOT_FOUND naming process 1) before either enters the
    load's collective, and the worker goes on serving version 0 in step. Then the follower is
    SIGKILLed: the lead ends (within the bound kill_and_wait asserts), non-zero, naming it."""
    from flax import nnx

    from rlax_tpu import models
    from rlax_tpu.param_server.client import ParamServerClient
    from rlax_tpu.param_server.service import serve as serve_param_server

    servers = [serve_param_server(ParamServerConfig(persist_every=0)) for _ in range(2)]
    endpoints = [f"127.0.0.1:{port}" for _, port, _ in servers]
    config = _local_config(SERVICE_INFERENCE)
    with ParamServerClient(endpoints[0]) as ps:
        ps.push(nnx.to_pure_dict(nnx.state(models.init_model(config.model, seed=1))), 1)
    procs = start(
        "inference",
        [
            *[f"--config.inference.{k}={v}" for k, v in SERVICE_INFERENCE.items()],
            "--config.inference.mesh.tensor=2",
            # The lead sees the death in 5 s (the default 20 s bound: tests/trainer's test).
            "--config.inference.distributed.heartbeat_timeout_s=5",
        ],
        [
            ["--config.inference.address=127.0.0.1:0", _endpoints(endpoints[0])],
            [_endpoints(endpoints[1])],
        ],
    )
    client = None
    try:
        client = InferenceClient(serving_endpoint(procs[0]))
        client.wait_ready(60)
        with pytest.raises(UnknownVersion, match="version 1 was not loaded: process 1: KeyError"):
            client.load_weights(1)
        rollouts = list(client.generate(random_requests(2, seed=3, temperature=0.0, max_new=4)))
        assert len(rollouts) == 2 and client.status().version == 0
        errs, took = kill_and_wait(procs, victim=1)
    finally:
        if client is not None:
            client.close()
        stop_all(procs)
        for server, _, store in servers:
            server.stop(None)
            store.close()
    assert procs[0].returncode not in (0, None), errs[0][-3000:]
    assert "stopped sending heartbeats):\n1\n" in errs[0], errs[0][-3000:]
    print(f"the lead ended {took:.1f} s after its follower was killed")


def _endpoints(endpoint: str) -> str:
    return f"--config.controller.param_server_endpoints=('{endpoint}',)"
