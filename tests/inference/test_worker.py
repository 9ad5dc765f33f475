"""InferenceWorker in-process, over gRPC on 127.0.0.1, and as `python -m rlax_tpu.inference`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rlax_tpu.inference.engine import InvalidRequest
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.service import InferenceClient, serve
from rlax_tpu.inference.worker import (
    DictWeightSource,
    InferenceWorker,
    UnknownVersion,
    VersionMismatch,
    WorkerShutdown,
)
from rlax_tpu.types import FinishReason

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


def test_generate_streams_every_sample_and_reload_hands_back_in_flight_ones(worker, tiny_model):
    requests = random_requests(4, seed=21, num_samples=2)
    slow = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=24,
                                                                  ignore_eos=True))
            for r in requests]  # fmt: skip
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
        local = by_key(worker.generate(requests))
        remote = by_key(client.generate(requests))
        assert remote.keys() == local.keys()
        for key, ro in local.items():
            np.testing.assert_array_equal(remote[key].tokens, ro.tokens)
            np.testing.assert_array_equal(remote[key].logprobs, ro.logprobs)  # f32 on the wire
            np.testing.assert_array_equal(remote[key].versions, ro.versions)
            assert remote[key].finish_reason is ro.finish_reason
        with pytest.raises(InvalidRequest, match="empty prompt"):
            client.generate([Request(prompt_id="x", prompt_tokens=())])
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
        [sys.executable, "-m", "rlax_tpu.inference", "--config=configs/codeforces.py:local",
         "--config.inference.address=127.0.0.1:0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, proc.stderr.read() if proc.poll() else line
        endpoint = line.split("serving on ", 1)[1].split()[0]
        client = InferenceClient(endpoint)
        client.wait_ready(30)
        (ro,) = client.generate([Request(prompt_id="p", prompt_tokens=(1, 2, 3),
                                         sampling=SamplingParams(max_new_tokens=4))])  # fmt: skip
        assert len(ro.tokens) <= 4 and ro.versions.tolist() == [0] * len(ro.tokens)
        with pytest.raises(UnknownVersion):
            client.load_weights(1)
        client.shutdown()
        client.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_the_service():
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlax_tpu.inference", "--config=configs/codeforces.py:local",
         "--config.inference.address=127.0.0.1:0"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "serving on" in proc.stdout.readline()
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_over_two_processes_serves_what_one_process_serves(tiny_model, tmp_path):
    """Two jax.distributed processes (gloo, 4 CPU devices each) make one worker on a data 2 x
    tensor 4 mesh: process 0 takes the calls, process 1 repeats its engine calls (lockstep) and
    pulls version 1 itself. Greedy tokens before and after the reload equal a one-process
    worker's."""
    import json
    import socket

    from flax import nnx

    from rlax_tpu import models

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    script, out = Path(__file__).with_name("distributed_worker.py"), tmp_path / "tokens.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen([sys.executable, str(script), coordinator, str(pid), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in (0, 1)
    ]  # fmt: skip
    other = nnx.state(models.init_model(models.preset("tiny"), seed=1))
    worker = InferenceWorker(tiny_model, SMALL, weight_source=DictWeightSource({1: other}))
    first = list(worker.generate(random_requests(6, seed=5, temperature=0.0)))
    worker.load_weights(1)
    second = list(worker.generate(random_requests(6, seed=6, temperature=0.0)))
    worker.shutdown()
    want = {f"{i}:{r.prompt_id}": r.tokens.tolist() for i, batch in enumerate((first, second))
            for r in batch}  # fmt: skip
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log[-3000:]
    assert json.loads(out.read_text()) == want
