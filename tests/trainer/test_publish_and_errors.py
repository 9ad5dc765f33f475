"""Publishing to a real parameter server (gRPC on 127.0.0.1), and bad input: batches that do not
fit the mesh, NaN losses under nan_policy 'skip' and 'stop' (never published)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.param_server.service import serve as serve_param_server
from rlax_tpu.trainer import BatchShapeError, NonFiniteLossError, Trainer, TrainerHalted
from rlax_tpu.trainer.publishing import PublishError

from .helpers import host, random_batch, run_config

# Rewards whose group mean overflows f32 (3e38 * 4 = inf): finite input, NaN advantages and loss.
OVERFLOW = np.full(16, 3e38, np.float32)


@pytest.fixture
def param_server():
    server, port, _ = serve_param_server(ParamServerConfig(persist_every=0))
    client = ParamServerClient(f"127.0.0.1:{port}")
    client.wait_ready()
    yield client
    client.close()
    server.stop(0)


def _versions(client):
    return [v.version for v in client.list_versions()[0]]


def test_publish_versions_and_skip_nan(param_server, tmp_path):
    cfg = run_config((1, 2, 1), publish_dtype="bfloat16", nan_policy="skip")
    trainer = Trainer(cfg, sink=param_server, devices=jax.devices()[:2], checkpoint_dir=tmp_path)
    assert trainer.publish() == 0
    trainer.train_step(random_batch(0))
    assert _versions(param_server) == [0, 1]
    pulled = param_server.pull(1)
    expected = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), trainer.params())
    assert pulled["embed"].dtype == jnp.bfloat16
    # (the server returns layers as a list where the trainer has a dict keyed 0..n-1)
    leaves = jax.tree.leaves(host(pulled))
    assert len(leaves) == len(jax.tree.leaves(expected))
    for a, b in zip(leaves, jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # A NaN step is skipped and reported: params and version unchanged, nothing published.
    before = host(trainer.params())
    metrics = trainer.train_step(random_batch(1, rewards=OVERFLOW))
    assert metrics["skipped"] == 1.0 and not np.isfinite(metrics["loss"])
    assert trainer.step == 1 and _versions(param_server) == [0, 1]
    jax.tree.map(np.testing.assert_array_equal, host(trainer.params()), before)
    # Training goes on after a skip.
    assert trainer.train_step(random_batch(2))["skipped"] == 0.0
    assert _versions(param_server) == [0, 1, 2]
    trainer.close()


def test_nan_stop_halts_until_restore(param_server, tmp_path):
    cfg = run_config(nan_policy="stop")
    trainer = Trainer(cfg, sink=param_server, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    trainer.train_step(random_batch(0))
    trainer.wait_for_checkpoints()
    with pytest.raises(NonFiniteLossError, match="non-finite update at step 1"):
        trainer.train_step(random_batch(1, rewards=OVERFLOW))
    assert trainer.status().halted and _versions(param_server) == [1]
    with pytest.raises(TrainerHalted, match="halted"):
        trainer.train_step(random_batch(2))
    assert trainer.restore() == 1 and not trainer.status().halted
    trainer.train_step(random_batch(2))
    assert _versions(param_server) == [1, 2]
    trainer.close()


def test_batches_that_do_not_fit_are_refused(tmp_path):
    cfg = run_config((8, 1, 1), micro_batch_size=4)
    trainer = Trainer(cfg, checkpoint_dir=tmp_path)
    with pytest.raises(BatchShapeError, match="do not split evenly over the mesh's 8 batch shards"):
        trainer.train_step(random_batch(0))
    trainer.close()
    trainer = Trainer(run_config((8, 1, 1)), checkpoint_dir=tmp_path)
    with pytest.raises(
        BatchShapeError, match="12 rows, not a multiple of trainer.micro_batch_size 8"
    ):
        trainer.train_step(random_batch(0, rows=12))
    with pytest.raises(ValueError, match="group_size 2 differs from algorithm.group_size 4"):
        trainer.train_step(dataclasses.replace(random_batch(0), group_size=2))
    trainer.close()


def test_at_publish_the_device_holds_the_state_and_the_published_copy_only(tmp_path):
    """train_step frees the step's micro-batches and objective inputs before publish, as the AOT
    check assumes (trainer/aot.py): the arrays made during the step that are still alive when the
    sink gets the weights are the new params, optimizer state, the published copy and scalars."""

    class Probe:
        def push(self, params, version):  # noqa: ANN001, ANN202
            self.live = jax.live_arrays()
            self.pushed = params

    probe = Probe()
    cfg = run_config(publish_dtype="bfloat16")
    cfg = dataclasses.replace(  # no checkpoint during the step
        cfg,
        trainer=dataclasses.replace(cfg.trainer, checkpoint_every=50),
        controller=dataclasses.replace(cfg.controller, snapshot_keep=51),
    )
    trainer = Trainer(cfg, sink=probe, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    keep = jax.live_arrays()  # held, so no later array reuses their ids
    before = {id(x) for x in keep}
    metrics = trainer.train_step(random_batch(0))
    assert metrics["micro_batches"] == 2.0
    made = [x for x in probe.live if id(x) not in before]
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    state = nbytes(trainer._trainable) + nbytes(trainer._opt_state) + nbytes(probe.pushed)
    extra = sum(x.nbytes for x in made) - state
    # Scalars only (loss, norms, temperature); one micro-batch's tokens alone are 2 KiB.
    assert 0 <= extra < 512, extra
    trainer.close()
    del keep


def test_a_version_in_parts_must_be_whole_on_a_quorum_of_replicas():
    """A replica commits a version published in parts only once every part reached it, so each
    process's part making its quorum is not enough (found by review): part 0 on {0, 1} and
    part 1 on {1, 2} leave it whole on replica 1 alone; on {0} and {1}, on none."""
    from rlax_tpu.trainer.trainer import parts_short_of_quorum

    assert parts_short_of_quorum([{0, 1}, {0, 1}], quorum=2) == ""
    assert parts_short_of_quorum([{0, 1}, {1, 2}], quorum=1) == ""
    assert parts_short_of_quorum([{0, 1}, {1, 2}], quorum=2) == (
        "is whole on replicas [1] only (the parts reached [[0, 1], [1, 2]]; quorum 2)"
    )
    assert "whole on replicas [] only" in parts_short_of_quorum([{0}, {1}], quorum=1)


class _Gated:
    """The parameter-server client as the sink, each push held until ``gate`` is set; logs
    when each push starts and ends."""

    def __init__(self, client, events: list[str], fail: set[int] = frozenset()):
        self.client, self.events, self.fail = client, events, fail
        self.gate = threading.Event()

    def push(self, params, version):
        self.events.append(f"push {version}")
        assert self.gate.wait(60)
        if version in self.fail:
            raise ConnectionError(f"no route to the parameter server for version {version}")
        out = self.client.push(params, version)
        self.events.append(f"pushed {version}")
        return out


def test_a_push_in_flight_lets_the_step_return_and_the_next_waits_for_it(param_server, tmp_path):
    """trainer.publish_in_flight 1: a step returns while its version is pushed (publish_pending),
    the version is neither published nor waited for by then, and the next step's publish waits
    until the push before it ended (one in flight); the versions land whole, in order."""
    events: list[str] = []
    sink = _Gated(param_server, events)
    cfg = run_config(publish_in_flight=1, publish_dtype="bfloat16")
    trainer = Trainer(cfg, sink=sink, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    try:
        assert trainer.train_step(random_batch(0))["publish_pending"] == 1.0
        assert trainer.status().published_version == -1 and _versions(param_server) == []
        with pytest.raises(TimeoutError, match="version 1 is still being published"):
            trainer.wait_published(1, timeout_s=0.1)

        def second() -> None:
            trainer.train_step(random_batch(1))
            events.append("step 2 returned")

        with cf.ThreadPoolExecutor(1) as pool:
            done = pool.submit(second)
            sink.gate.set()
            done.result(timeout=120)
        assert events.index("pushed 1") < events.index("push 2") < events.index("step 2 returned")
        assert trainer.wait_published(2) == 2 and _versions(param_server) == [1, 2]
        expected = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), trainer.params())
        for a, b in zip(
            jax.tree.leaves(host(param_server.pull(2))), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    finally:
        sink.gate.set()
        trainer.close()


def test_a_failed_push_in_flight_stops_the_next_step_until_it_is_published_again(
    param_server, tmp_path
):
    """A push that failed on its thread is raised by wait_published and by the next step before
    its update (the run never goes on past a version it did not publish); publishing the
    version again (a resume's ensure_versions), or a restore, forgets it."""
    sink = _Gated(param_server, [], fail={1, 3})
    sink.gate.set()
    cfg = run_config(publish_in_flight=1)
    trainer = Trainer(cfg, sink=sink, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    try:
        trainer.train_step(random_batch(0))
        with pytest.raises(PublishError, match="version 1 was not published: ConnectionError"):
            trainer.wait_published(1)
        with pytest.raises(PublishError, match="version 1 was not published"):
            trainer.train_step(random_batch(1))
        assert trainer.step == 1  # refused before the update
        sink.fail = {3}  # the parameter server is back
        assert trainer.publish() == 1  # synchronous: waits, then stands for the failed push
        trainer.train_step(random_batch(1))
        trainer.wait_for_checkpoints()
        trainer.train_step(random_batch(2))  # version 3's push fails
        with pytest.raises(PublishError, match="version 3 was not published"):
            trainer.wait_published(3)
        assert trainer.restore(2) == 2  # a restore forgets it too
        sink.fail = set()
        trainer.train_step(random_batch(2))
        assert trainer.wait_published(3) == 3 and _versions(param_server) == [1, 2, 3]
    finally:
        trainer.close()
