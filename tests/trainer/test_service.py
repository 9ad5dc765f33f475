"""The gRPC face: ``python -m rlax_tpu.trainer`` starts and answers; TrainStep over gRPC equals
the in-process call; bad input and missing credentials get clear statuses."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.service import serve as serve_param_server
from rlax_tpu.rpc.transport import Credentials
from rlax_tpu.trainer import Trainer, TrainerClient
from rlax_tpu.trainer.service import serve

from .helpers import random_batch, run_config

REPO = Path(__file__).resolve().parents[2]


def test_module_entry_point_serves_publishes_and_stops(tmp_path):
    """The command serves, publishes to a real parameter server at the configured endpoint, and
    stops on SIGTERM."""
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    ps_server, ps_port, ps_store = serve_param_server(ParamServerConfig())
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlax_tpu.trainer", "--config=configs/codeforces.py:local",
         f"--config.controller.run_dir={tmp_path}", "--config.model.num_layers=1",
         f"--config.controller.param_server_endpoints=('127.0.0.1:{ps_port}',)"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("rlax_tpu.trainer: serving on 127.0.0.1:"), (
            line,
            proc.stderr.read(),
        )
        endpoint = line.split("serving on ")[1].strip()
        with TrainerClient(endpoint) as client:
            client.wait_ready(30)
            status = client.status()
            assert status.step == 0 and status.mesh == {"data": 1, "fsdp": 2, "tensor": 1}
            assert client.health().serving
            client.publish()  # version 0 goes to the parameter server
        versions, latest = ParamServerClient(f"127.0.0.1:{ps_port}").list_versions()
        assert latest == 0 and [v.version for v in versions] == [0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        proc.kill()
        ps_server.stop(None)
        ps_store.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text("s3cret\n")
    cfg = run_config((1, 2, 1), auth_token_file=str(token))
    trainer = Trainer(cfg, devices=jax.devices()[:2], checkpoint_dir=tmp_path_factory.mktemp("c"))
    server, port = serve(trainer, cfg.trainer)
    yield f"127.0.0.1:{port}", Credentials(auth_token_file=str(token)), cfg
    server.stop(0)
    trainer.close()


def test_grpc_step_equals_in_process(served, tmp_path):
    endpoint, creds, cfg = served
    with TrainerClient(endpoint, credentials=creds) as client:
        remote = client.train_step(random_batch(0))
        assert client.status().step == 1
        assert client.save(wait=True) == 1
        assert 1 in client.status().checkpoint_steps
        assert client.restore() == 1
    local = Trainer(cfg, devices=jax.devices()[:2], checkpoint_dir=tmp_path)
    expected = local.train_step(random_batch(0))
    local.close()
    for name in ("loss", "grad_norm", "update_norm", "padding_fraction"):
        assert remote[name] == expected[name], name


def test_grpc_errors_are_clear(served):
    endpoint, creds, _ = served
    with TrainerClient(endpoint) as anonymous, pytest.raises(grpc.RpcError) as e:
        anonymous.status()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with TrainerClient(endpoint, credentials=creds) as client:
        bad = dataclasses.replace(random_batch(1), group_size=2)  # the config's G is 4
        with pytest.raises(grpc.RpcError) as e:
            client.train_step(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "group_size 2 differs from algorithm.group_size" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            client.restore(99)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_wire_roundtrip():
    from rlax_tpu.trainer.wire import batch_from_pb, batch_to_pb

    batch = random_batch(2)
    back = batch_from_pb(batch_to_pb(batch))
    for name in ("tokens", "prompt_lengths", "completion_lengths", "behaviour_logprobs", "rewards",
                 "versions"):  # fmt: skip
        a, b = getattr(batch, name), getattr(back, name)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert (back.group_size, back.temperature) == (batch.group_size, batch.temperature)
