"""InferenceWorker in-process, over gRPC on 127.0.0.1, and as `python -m rlax_tpu.inference`."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from rlax_tpu.cli import EXIT_STOPPED
from rlax_tpu.config import MeshConfig
from rlax_tpu.inference.engine import InvalidRequest
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.service import InferenceClient, sampling_from_pb, sampling_to_pb, serve
from rlax_tpu.inference.worker import (
    DictWeightSource,
    InferenceWorker,
    UnknownVersion,
    VersionMismatch,
    WorkerShutdown,
)
from rlax_tpu.types import FinishReason
from tests.child_env import child_env

from .conftest import SMALL, by_key, random_requests

REPO = Path(__file__).resolve().parents[2]

BAD = {
    "empty prompt": (Request(prompt_id="x", prompt_tokens=()), "empty prompt"),
    "over-length prompt": (
        Request(prompt_id="x", prompt_tokens=tuple(range(25))),
        "longer than inference.max_prompt_len = 24",
    ),
    "token outside vocab": (
        Request(prompt_id="x", prompt_tokens=(1, 512)),
        "outside the vocabulary",
    ),
    "negative temperature": (
        Request(prompt_id="x", prompt_tokens=(1,), sampling=SamplingParams(temperature=-1.0)),
        "temperature = -1.0: must be >= 0",
    ),
    "top_p zero": (
        Request(prompt_id="x", prompt_tokens=(1,), sampling=SamplingParams(top_p=0.0)),
        r"top_p = 0.0: must be in \(0, 1\]",
    ),
    "too many new tokens": (
        Request(prompt_id="x", prompt_tokens=(1,), sampling=SamplingParams(max_new_tokens=25)),
        r"max_new_tokens = 25: must be in \[1, 24\]",
    ),
    "too many samples": (
        Request(prompt_id="x", prompt_tokens=(1,), num_samples=9),
        "num_samples = 9 must be in",
    ),
}


@pytest.fixture
def worker(tiny_model):
    source = DictWeightSource({0: jax.tree.map(lambda x: x, _state(tiny_model))})
    w = InferenceWorker(tiny_model, SMALL, weight_source=source)
    yield w
    w.shutdown()


def _state(model):
    from flax import nnx

    return nnx.state(model)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_rejected_before_anything_is_queued(worker, case):
    request, message = BAD[case]
    good = Request(prompt_id="ok", prompt_tokens=(1, 2))
    with pytest.raises(InvalidRequest, match=message):
        worker.generate([good, request])
    assert worker.status().waiting == 0 and worker.status().running == 0


def test_versions_unknown_or_mismatched_are_errors(worker):
    with pytest.raises(UnknownVersion, match="no weights for version 5"):
        worker.load_weights(5)
    with pytest.raises(VersionMismatch, match="requested version 2, the worker holds 0"):
        worker.generate([Request(prompt_id="a", prompt_tokens=(1,))], version=2)


@pytest.fixture
def draining_worker(tiny_model):
    """A worker whose reloads abort what runs (``overlap_reload`` off)."""
    source = DictWeightSource({0: jax.tree.map(lambda x: x, _state(tiny_model))})
    w = InferenceWorker(
        tiny_model, dataclasses.replace(SMALL, overlap_reload=False), weight_source=source
    )
    yield w
    w.shutdown()


def test_generate_streams_every_sample_and_reload_hands_back_in_flight_ones(
    draining_worker, tiny_model
):
    worker = draining_worker
    requests = random_requests(4, seed=21, num_samples=2)
    slow = [
        dataclasses.replace(
            r, sampling=dataclasses.replace(r.sampling, max_new_tokens=24, ignore_eos=True)
        )
        for r in requests
    ]
    first = list(worker.generate(requests[:1], version=0))
    assert sorted(r.sample_index for r in first) == [0, 1] and first[0].prompt_id == "r0"
    stream = worker.generate(slow)
    got = []
    worker.weight_source.versions[1] = jax.tree.map(lambda x: x * 0.5, _state(tiny_model))
    # Reload while the requests run: whatever did not finish comes back ABORTED.
    aborted = worker.load_weights(1)
    got += list(stream)
    assert len(got) == 8 and {(r.prompt_id, r.sample_index) for r in got} == {
        (f"r{i}", j) for i in range(4) for j in range(2)
    }
    assert sum(r.finish_reason is FinishReason.ABORTED for r in got) == aborted
    assert worker.status().version == 1
    after = list(worker.generate(requests[:1]))
    assert all((r.versions == 1).all() for r in after)


class _WatchedSource(DictWeightSource):
    """Records, for each fetch, the version its worker still kept older weights of then."""

    def __init__(self, versions: dict):
        super().__init__(versions)
        self.worker: InferenceWorker | None = None
        self.older_at_fetch: dict[int, int | None] = {}

    def fetch(self, version: int) -> Any:
        self.older_at_fetch[version] = self.worker.engine.older_version
        return super().fetch(version)


def test_a_reload_over_grpc_does_not_wait_for_running_samples_nor_fetch_a_third_copy(tiny_model):
    """``overlap_reload``: the client's generate returns once its requests are queued (not at
    the first sample), a load under them aborts none, they stream on with version 0's tokens, a
    version-0 generate is still taken while the worker holds those weights, and the next staged
    version is fetched only once the older copy is gone (two copies at most)."""
    state = _state(tiny_model)
    source = _WatchedSource({0: state, 1: jax.tree.map(lambda x: x * 0.5, state)})
    source.versions[2] = source.versions[1]
    cfg = dataclasses.replace(SMALL, overlap_reload=True)
    worker = source.worker = InferenceWorker(tiny_model, cfg, weight_source=source)
    server, port = serve(worker, "127.0.0.1:0")
    client = InferenceClient(f"127.0.0.1:{port}")
    slow = [
        dataclasses.replace(
            r, sampling=dataclasses.replace(r.sampling, max_new_tokens=24, ignore_eos=True)
        )
        for r in random_requests(3, seed=21, num_samples=2)
    ]
    gate, step = threading.Event(), worker.engine.step
    worker.engine.step = lambda: gate.wait() and step()  # no sample ends before gate.set()
    try:
        client.wait_ready(10)
        call = cf.ThreadPoolExecutor(1).submit(client.generate, slow[:2], version=0)
        stream = call.result(timeout=60)  # returned with nothing generated yet
        gate.set()
        assert client.load_weights(1) == 0
        late = client.generate(slow[2:], version=0)  # the older weights still run
        worker.stage(2)
        got = list(stream) + list(late)
        assert len(got) == 6 and all(len(r.tokens) == 24 for r in got)
        assert all(r.finish_reason is FinishReason.LENGTH and (r.versions == 0).all() for r in got)
        deadline = time.monotonic() + 60
        while 2 not in source.older_at_fetch and time.monotonic() < deadline:
            time.sleep(0.05)
        assert source.older_at_fetch[2] is None
        assert worker.version == 1 and worker.engine.older_version is None
        with pytest.raises(VersionMismatch):
            client.generate(slow[:1], version=0)
    finally:
        gate.set()
        client.close()
        server.stop(None)
        worker.shutdown()


def test_shutdown_aborts_and_refuses(tiny_model):
    w = InferenceWorker(tiny_model, SMALL)
    w.shutdown()
    with pytest.raises(WorkerShutdown):
        w.generate([Request(prompt_id="a", prompt_tokens=(1,))])
    assert not w.status().serving


def test_grpc_round_trip_on_loopback(worker):
    server, port = serve(worker, "127.0.0.1:0")
    client = InferenceClient(f"127.0.0.1:{port}")
    try:
        client.wait_ready(10)
        requests = random_requests(3, seed=31, num_samples=2, temperature=0.9, top_k=50)
        # One continues a sequence (an episode's next turn): its held tokens cross the wire too.
        requests[1] = dataclasses.replace(requests[1], continuation=(7, 8, 9))
        # Another keeps its pages for a next turn: the kept flag crosses the wire (the status
        # counts what a continuation took from them).
        requests[2] = dataclasses.replace(requests[2], keep_pages=True)
        local = by_key(
            worker.generate([dataclasses.replace(r, keep_pages=False) for r in requests])
        )
        remote = by_key(client.generate(requests))
        nxt = dataclasses.replace(
            requests[2],
            prompt_id="next",
            num_samples=1,
            keep_pages=False,
            continuation=(*remote[requests[2].prompt_id, 0].tokens.tolist(), 5),
        )
        before = client.status().prefix_tokens_reused
        next(client.generate([nxt]))
        assert client.status().prefix_tokens_reused > before
        assert remote.keys() == local.keys()
        for key, ro in local.items():
            np.testing.assert_array_equal(remote[key].tokens, ro.tokens)
            np.testing.assert_array_equal(remote[key].logprobs, ro.logprobs)  # f32 on the wire
            np.testing.assert_array_equal(remote[key].versions, ro.versions)
            assert remote[key].finish_reason is ro.finish_reason
        with pytest.raises(InvalidRequest, match="empty prompt"):
            client.generate([Request(prompt_id="x", prompt_tokens=())])
        # Stops cross the wire (this worker has no tokenizer: its refusal of a string says so).
        stops = SamplingParams(temperature=0.0, stop_sequences=((3, 4), (5,)), stop=("</a>",))
        assert sampling_from_pb(sampling_to_pb(stops)) == stops
        with pytest.raises(InvalidRequest, match="need the worker's tokenizer"):
            client.generate([Request(prompt_id="x", prompt_tokens=(1, 2), sampling=stops)])
        with pytest.raises(UnknownVersion):
            client.load_weights(9)
        with pytest.raises(VersionMismatch):
            client.generate(requests, version=4)
        status = client.status()
        assert status.version == 0 and status.serving and status.backend == "cpu"
        assert status.generated_tokens >= sum(len(r.tokens) for r in local.values())
        client.shutdown()
        with pytest.raises(WorkerShutdown):
            client.generate(requests)
    finally:
        client.close()
        server.stop(None)


def test_python_m_rlax_tpu_inference_serves_and_stops(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.inference",
            "--config=configs/codeforces.py:local",
            "--config.inference.address=127.0.0.1:0",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, proc.stderr.read() if proc.poll() else line
        endpoint = line.split("serving on ", 1)[1].split()[0]
        client = InferenceClient(endpoint)
        client.wait_ready(30)
        (ro,) = client.generate(
            [
                Request(
                    prompt_id="p",
                    prompt_tokens=(1, 2, 3),
                    sampling=SamplingParams(max_new_tokens=4),
                )
            ]
        )
        assert len(ro.tokens) <= 4 and ro.versions.tolist() == [0] * len(ro.tokens)
        with pytest.raises(UnknownVersion):
            client.load_weights(1)
        client.shutdown()
        client.close()
        assert proc.wait(timeout=60) == EXIT_STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_the_service():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.inference",
            "--config=configs/codeforces.py:local",
            "--config.inference.address=127.0.0.1:0",
        ],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "serving on" in proc.stdout.readline()
        proc.terminate()
        assert proc.wait(timeout=60) == EXIT_STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A small engine for the multi-process service test (the local preset's model).
SERVICE_INFERENCE = dict(
    max_concurrent_seqs=8,
    page_size=4,
    kv_cache_bytes=2**20,
    prefill_chunk=8,
    max_prompt_len=24,
    max_new_tokens=16,
)


def _local_config(inference: dict) -> Any:
    """configs/codeforces.py:local with ``inference`` fields replaced."""
    import importlib.util

    from rlax_tpu.config import RunConfig, from_dict

    spec = importlib.util.spec_from_file_location("codeforces", REPO / "configs" / "codeforces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("local").to_dict()
    cfg["inference"] |= inference
    return from_dict(RunConfig, cfg)


def _own_slice_bytes(shardings: Any, shapes: Any, hosts: list[set]) -> int:
    """Bytes the processes of ``hosts`` (each a set of devices) pull if each fetches every
    distinct slice its devices hold once."""
    total = 0
    for sharding, shape in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes), strict=True):
        for devices in hosts:
            boxes = {
                tuple((s.start or 0, s.stop or n) for s, n in zip(index, shape.shape, strict=True))
                for d, index in sharding.devices_indices_map(shape.shape).items()
                if d in devices
            }
            total += sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * shape.dtype.itemsize
    return total


@pytest.mark.slow
def test_python_m_rlax_tpu_inference_over_two_processes(tmp_path):
    """One worker over two hosts, as `python -m rlax_tpu.inference` twice (jax.distributed on
    127.0.0.1, gloo, 2 CPU devices each) on a tensor-4 mesh that spans both: process 0 serves,
    process 1 follows. Both pull version 1 from a parameter server, staged ahead while a batch
    runs, each once and only its own devices' slices (bytes counted by the server). Greedy tokens before and after the reload equal a
    one-device worker's."""
    from flax import nnx

    from rlax_tpu import models
    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.inference.engine import Engine
    from rlax_tpu.param_server.client import ParamServerClient, PulledWeights
    from rlax_tpu.param_server.service import serve as serve_param_server
    from tests.conftest import free_port

    ps_server, ps_port, ps_store = serve_param_server(ParamServerConfig(persist_every=0))
    ps = ParamServerClient(f"127.0.0.1:{ps_port}")
    coordinator = f"127.0.0.1:{free_port()}"
    flags = [f"--config.inference.{k}={v}" for k, v in SERVICE_INFERENCE.items()]
    common = [
        "--config=configs/codeforces.py:local",
        *flags,
        "--config.inference.mesh.tensor=4",
        f"--config.controller.param_server_endpoints=('127.0.0.1:{ps_port}',)",
        f"--config.inference.distributed.coordinator_address={coordinator}",
        "--config.inference.distributed.num_processes=2",
    ]
    env = child_env(devices=2)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlax_tpu.inference",
                *common,
                f"--config.inference.distributed.process_id={pid}",
                "--config.inference.address=127.0.0.1:0",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    client = None
    try:
        # The reference: the same config on one device, in this process, from the same server.
        config = _local_config(SERVICE_INFERENCE)
        reference = InferenceWorker.from_config(config)
        other = nnx.to_pure_dict(nnx.state(models.init_model(config.model, seed=1)))
        ps.push(other, 1)
        reference.weight_source = PulledWeights(ps, reference.engine.weight_shardings())
        batches = [
            random_requests(6, seed=5, temperature=0.0, max_new=16),
            random_requests(6, seed=6, temperature=0.0, max_new=16),
        ]
        want = [by_key(reference.generate(batches[0]))]
        reference.load_weights(1)
        want.append(by_key(reference.generate(batches[1])))
        reference.shutdown()

        line = ""
        while "serving on" not in line and (line := procs[0].stdout.readline()):
            pass  # gloo prints its own lines first
        assert "serving on 127.0.0.1:" in line, procs[0].stderr.read()[-3000:]
        client = InferenceClient(line.split("serving on ", 1)[1].split()[0])
        client.wait_ready(60)
        served = ps_store.bytes_served()
        stream = client.generate(batches[0])
        # Both processes fetch version 1 ahead (the lead's standby, the follower's at its next
        # lockstep point): the load swaps it in, and each still pulls it once (counted below).
        client.stage(1)
        got = [by_key(stream)]
        assert client.load_weights(1) == 0 and client.status().version == 1
        got.append(by_key(client.generate(batches[1])))
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys()
            for key in w:
                np.testing.assert_array_equal(g[key].tokens, w[key].tokens)
                np.testing.assert_allclose(g[key].logprobs, w[key].logprobs, atol=2e-5)
        client.shutdown()
        for p in procs:
            assert p.wait(timeout=120) == EXIT_STOPPED, p.stderr.read()[-3000:]
        assert "follower stopped after" in procs[1].stdout.read()
        pulled = ps_store.bytes_served() - served  # the follower pulls at its next step
        # Each process pulled only its own devices' slices: what a tensor-4 mesh over this
        # process's devices 0,1 | 2,3 would hold, and less than two whole copies.
        mesh_cfg = dataclasses.replace(config.inference, mesh=MeshConfig(data=1, fsdp=1, tensor=4))
        engine = Engine(models.init_model(config.model), mesh_cfg, devices=jax.devices()[:4])
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), other)
        devs = jax.devices()
        expected = _own_slice_bytes(
            engine.weight_shardings(), shapes, [set(devs[:2]), set(devs[2:4])]
        )
        whole = sum(a.nbytes for a in jax.tree.leaves(other))
        assert pulled == expected < 2 * whole, (pulled, expected, whole)
    finally:
        if client is not None:
            client.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        ps.close()
        ps_server.stop(None)
        ps_store.close()
