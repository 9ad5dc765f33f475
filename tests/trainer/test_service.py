"""The gRPC face: ``python -m rlax_tpu.trainer`` starts and answers; TrainStep over gRPC equals
the in-process call; bad input and missing credentials get clear statuses."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest

from rlax_tpu.cli import EXIT_STOPPED
from rlax_tpu.config import ParamServerConfig, RunConfig, from_dict
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.service import serve as serve_param_server
from rlax_tpu.rpc.transport import ComponentFailed, Credentials, Named
from rlax_tpu.trainer import Trainer, TrainerClient
from rlax_tpu.trainer.service import serve
from tests.child_env import child_env

from .helpers import GROUP, random_batch, run_config

REPO = Path(__file__).resolve().parents[2]


def test_module_entry_point_serves_publishes_and_stops(tmp_path):
    """The command serves, publishes to a real parameter server at the configured endpoint, and
    stops on SIGTERM."""
    env = child_env(devices=2)
    ps_server, ps_port, ps_store = serve_param_server(ParamServerConfig())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.trainer",
            "--config=configs/codeforces.py:local",
            f"--config.controller.run_dir={tmp_path}",
            "--config.model.num_layers=1",
            f"--config.controller.param_server_endpoints=('127.0.0.1:{ps_port}',)",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        layout = proc.stdout.readline()
        assert layout.startswith("rlax_tpu.trainer: process 0 of 1, mesh data 1 x fsdp 2"), layout
        line = proc.stdout.readline()
        assert line.startswith("rlax_tpu.trainer: serving on 127.0.0.1:"), line
        endpoint = line.split("serving on ")[1].strip()
        with TrainerClient(endpoint) as client:
            client.wait_ready(30)
            status = client.status()
            assert status.step == 0 and status.mesh == {
                "data": 1,
                "fsdp": 2,
                "expert": 1,
                "tensor": 1,
            }
            assert client.health().serving
            client.publish()  # version 0 goes to the parameter server
        versions, latest = ParamServerClient(f"127.0.0.1:{ps_port}").list_versions()
        assert latest == 0 and [v.version for v in versions] == [0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == EXIT_STOPPED
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
    # 2 KiB slices: the batch (~17 KB) travels as 10 messages of a streamed TrainStep.
    with TrainerClient(endpoint, credentials=creds, chunk_bytes=2048) as client:
        remote = client.train_step(random_batch(0))
        assert client.status().step == 1
        assert client.save(wait=True) == 1
        assert 1 in client.status().checkpoint_steps
        assert client.restore() == 1
        remote_advantages = client.last_row_advantages
    local = Trainer(cfg, devices=jax.devices()[:2], checkpoint_dir=tmp_path)
    expected = local.train_step(random_batch(0))
    local.close()
    for name in ("loss", "grad_norm", "update_norm", "padding_fraction"):
        assert remote[name] == expected[name], name
    # The batch's advantage per row came back with the step (float32, as computed): GRPO's,
    # (r - group mean) / (sample std + 1e-6), the same on each of a row's tokens.
    np.testing.assert_array_equal(remote_advantages, local.last_row_advantages)
    rewards = random_batch(0).rewards.reshape(-1, GROUP).astype(np.float64)
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    textbook = centered / (rewards.std(axis=1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(remote_advantages, textbook.reshape(-1), rtol=1e-5, atol=1e-6)


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
        # A caller that expects another step (the trainer restarted unseen) is refused as if the
        # trainer were gone, and nothing is trained; the controller names it and recovers.
        step = client.status().step
        named = Named(client, "trainer", endpoint)
        with pytest.raises(
            ComponentFailed,
            match=rf"trainer at {endpoint} stopped answering "
            rf"\(UNAVAILABLE: TrainerStateLost: the trainer is at step {step}, "
            rf"not {step + 5}",
        ):
            named.train_step(random_batch(1), expect_step=step + 5)
        assert client.status().step == step
        client.train_step(random_batch(1), expect_step=step)
        assert client.status().step == step + 1


@pytest.mark.parametrize("multi_turn", [False, True])  # with a loss mask and MoE routes
@pytest.mark.parametrize("chunk_bytes", [1, 3000, 2**30])
def test_wire_roundtrip(chunk_bytes, multi_turn):
    """A batch streamed as row slices (one row each, a few rows, all at once) joins back equal,
    and no slice is larger than chunk_bytes unless it holds a single row."""
    from rlax_tpu.trainer.wire import batch_from_chunks, batch_to_chunks

    batch = random_batch(2)
    if multi_turn:
        mask = (np.arange(batch.behaviour_logprobs.size) % 3 > 0).astype(np.float32)
        routes = np.random.default_rng(0).integers(-1, 8, (*batch.tokens.shape, 2, 3))
        batch = dataclasses.replace(
            batch,
            loss_mask=mask.reshape(batch.behaviour_logprobs.shape),
            routes=routes.astype(np.int16),
        )
    chunks = list(batch_to_chunks(batch, chunk_bytes))
    rows = [len(c.prompt_lengths.shape) and c.prompt_lengths.shape[0] for c in chunks]
    assert sum(rows) == len(batch.tokens)
    assert all(
        c.ByteSize() <= chunk_bytes + 1024 or r == 1 for c, r in zip(chunks, rows, strict=True)
    )
    back = batch_from_chunks(chunks)
    for name in (
        "tokens",
        "prompt_lengths",
        "completion_lengths",
        "behaviour_logprobs",
        "rewards",
        "versions",
        *(("loss_mask", "routes") if multi_turn else ()),
    ):
        a, b = getattr(batch, name), getattr(back, name)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert (back.loss_mask is None) == (back.routes is None) == (not multi_turn)
    assert (back.group_size, back.temperature) == (batch.group_size, batch.temperature)
    with pytest.raises(ValueError, match="no batch"):
        batch_from_chunks([])


# The overrides of configs/codeforces.py:local that make helpers.run_config((1, 8, 1)) shapes.
TWO_HOSTS = {
    "model.num_layers": 2,
    "mesh.data": 1,
    "mesh.fsdp": 8,
    "mesh.tensor": 1,
    "trainer.learning_rate": 1e-3,
    "trainer.micro_batch_size": 8,
    "trainer.length_bucket": 64,
    "trainer.align_logprobs": False,
    "trainer.adam_eps": 1e-5,
    "inference.prefill_chunk": 8,
    "inference.max_prompt_len": 16,
    "inference.max_new_tokens": 24,
    "controller.prompts_per_step": 4,
    "algorithm.group_size": 4,
}


def _local_with(overrides: dict) -> RunConfig:
    import importlib.util

    spec = importlib.util.spec_from_file_location("codeforces", REPO / "configs" / "codeforces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    d = module.get_config("local").to_dict()
    for path, value in overrides.items():
        section, field = path.split(".")
        d[section][field] = value
    return from_dict(RunConfig, d)


@pytest.mark.slow
def test_a_trainer_over_two_processes_serves_one_endpoint(tmp_path):
    """`python -m rlax_tpu.trainer` as the two processes of one jax.distributed job (gloo, 4 CPU
    devices each, parameters split 8 ways over fsdp): process 0 serves gRPC, process 1 makes every
    call it makes. After 3 updates the published version equals a one-process trainer's on 8
    devices (1e-5: the cross-process sums run through gloo in another order, 3 Adam steps of lr
    1e-3), and each process published only its half of the parameters. The pushes run in the
    background (trainer.publish_in_flight 1: each process's part on a thread, the processes
    agreeing on a named exchange), and WaitPublished answers once every part is in."""
    from tests.conftest import free_port

    ps_server, ps_port, ps_store = serve_param_server(ParamServerConfig(persist_every=0))
    coordinator = f"127.0.0.1:{free_port()}"
    flags = [f"--config.{k}={v}" for k, v in TWO_HOSTS.items()]
    env = child_env(devices=4)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlax_tpu.trainer",
                "--config=configs/codeforces.py:local",
                *flags,
                f"--config.controller.run_dir={tmp_path / 'run'}",
                "--config.trainer.address=127.0.0.1:0",
                "--config.trainer.publish_in_flight=1",
                f"--config.controller.param_server_endpoints=('127.0.0.1:{ps_port}',)",
                f"--config.trainer.distributed.coordinator_address={coordinator}",
                "--config.trainer.distributed.num_processes=2",
                f"--config.trainer.distributed.process_id={pid}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    try:
        reference = Trainer(_local_with(TWO_HOSTS), checkpoint_dir=tmp_path / "one")
        for seed in range(3):
            reference.train_step(random_batch(seed))
        want = jax.tree.leaves(jax.tree.map(np.asarray, reference.params()))
        reference.close()
        line = ""
        while "serving on" not in line and (line := procs[0].stdout.readline()):
            pass  # gloo prints its own lines first
        assert "serving on 127.0.0.1:" in line, procs[0].stderr.read()[-3000:]
        with TrainerClient(line.split("serving on ")[1].strip()) as client:
            client.wait_ready(60)
            assert client.status().process_count == 2
            for seed in range(3):
                assert client.train_step(random_batch(seed))["publish_pending"] == 1.0
            assert client.wait_published(3) == 3 and client.status().published_version == 3
        procs[0].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [EXIT_STOPPED] * 2, [
            p.stderr.read()[-2000:] for p in procs
        ]
        got = jax.tree.leaves(ParamServerClient(f"127.0.0.1:{ps_port}").pull(3))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-5)
        whole = sum(w.nbytes for w in want)
        pushed = [int(o.rsplit("published ", 1)[1].split()[0]) for o in outs]
        assert sum(pushed) == 3 * whole and max(pushed) < 0.6 * 3 * whole, (pushed, whole)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        ps_server.stop(None)
        ps_store.close()


def test_a_push_in_flight_is_waited_for_and_its_failure_named_over_grpc(tmp_path):
    """WaitPublished answers beside the serialized calls: once a version's push on its thread
    ended, with the newest version published, or FAILED_PRECONDITION naming why it was not,
    which the client raises as PublishError; the next step is refused for it too."""
    from rlax_tpu.trainer.publishing import PublishError

    class Sink:  # version 1 lands, version 2 cannot
        def __init__(self):
            self.pushed = []

        def push(self, params, version):
            if version == 2:
                raise ConnectionError("no route to the parameter server")
            self.pushed.append(version)

    sink = Sink()
    cfg = run_config(publish_in_flight=1)
    trainer = Trainer(cfg, sink=sink, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    server, port = serve(trainer, cfg.trainer)
    try:
        with TrainerClient(f"127.0.0.1:{port}") as client:
            assert client.train_step(random_batch(0))["publish_pending"] == 1.0
            assert client.wait_published(1) == 1 and sink.pushed == [1]
            client.train_step(random_batch(1))
            deadline = time.monotonic() + 60
            while (status := client.status()).publishing and time.monotonic() < deadline:
                time.sleep(0.01)  # version 2's push, on its thread
            # The failure is visible in the status before anything raises it.
            assert status.publishing == () and status.publish_failed.startswith(
                "version 2 was not published: ConnectionError: no route"
            )
            assert "version 2 was not published" in client.health().detail
            with pytest.raises(PublishError, match="version 2 was not published: ConnectionError"):
                client.wait_published(2)
            with pytest.raises(grpc.RpcError) as refused:
                client.train_step(random_batch(2))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "version 2 was not published" in refused.value.details()
    finally:
        server.stop(0)
        trainer.close()
