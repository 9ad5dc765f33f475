"""The controller's distributed transport against every component as its own process on 127.0.0.1.

Each service is started with `python -m rlax_tpu.<component>` (ephemeral port, parsed from the
line it prints once it serves), all with the same run directory and model section, so the trainer
and the inference worker initialize the same version-0 weights; then `python -m
rlax_tpu.controller --config.controller.transport=distributed` runs a tiny job against them.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from rlax_tpu.cli import EXIT_STOPPED
from rlax_tpu.inference.service import InferenceClient
from tests.child_env import child_env
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = "--config=configs/codeforces.py:local"
READY_TIMEOUT_S = 120
ADDRESS = re.compile(r"(127\.0\.0\.1:\d+)")


def _env() -> dict[str, str]:
    # One CPU device per process (conftest forces 8 for in-process tests): the services share
    # two cores, and nothing here needs a mesh.
    return child_env()


class Service:
    """A `python -m rlax_tpu.<module>` child whose merged stdout/stderr is drained by a thread
    (kept for failure messages)."""

    def __init__(self, module: str, args: list[str]):
        self.module = module
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"rlax_tpu.{module}", CONFIG, *args],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._terminated = False
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def output(self) -> str:
        return "".join(self.lines)[-4000:]

    def wait_for(self, marker: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The host:port of the first line containing ``marker``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{self.module}: no {marker!r} line within {timeout_s} s:\n{self.output()}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"{self.module} exited ({self.proc.wait()}) before "
                    f"printing {marker!r}:\n{self.output()}"
                )
            if marker in line and (m := ADDRESS.search(line)):
                return m.group(1)

    def terminate(self) -> None:
        """One SIGTERM (a second one could land after the service's handler is gone, while
        the interpreter shuts down, and kill it)."""
        if not self._terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def _workload(run_dir: Path) -> list[str]:
    """Overrides every process gets: one run directory, one model (seeded init), a tiny job."""
    return [
        f"--config.controller.run_dir={run_dir}",
        "--config.controller.num_steps=2",
        "--config.controller.prompts_per_step=2",
        "--config.algorithm.group_size=2",
        "--config.trainer.micro_batch_size=4",
        "--config.model.num_layers=1",  # compile time grows with the (unrolled) layers
        "--config.inference.max_new_tokens=16",
        "--config.inference.max_concurrent_seqs=8",
        "--config.data.eval_problems=4",
        "--config.data.eval_samples=2",
        "--config.controller.warmup_steps=0",  # a warm-up needs the trainer in process
    ]


def _controller(
    args: list[str], timeout_s: float, transport: str = "distributed"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_tpu.controller",
            CONFIG,
            f"--config.controller.transport={transport}",
            "--config.controller.warmup_steps=0",
            *args,
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_distributed_run_against_separate_processes(tmp_path):
    run_dir = tmp_path / "run"
    common = _workload(run_dir)
    services: list[Service] = []
    try:
        ps = Service("param_server", [*common, "--config.param_server.address=127.0.0.1:0"])
        services.append(ps)
        ps_endpoint = ps.wait_for("param_server listening on")
        wired = [*common, f"--config.controller.param_server_endpoints=('{ps_endpoint}',)"]
        uid = 1_800_000 + (os.getpid() % 100_000) * 8
        trainer = Service("trainer", [*wired, "--config.trainer.address=127.0.0.1:0"])
        services.append(trainer)
        verifiers = Service(
            "verifiers",
            [
                *wired,
                "--config.verifiers.address=127.0.0.1:0",
                f"--config.verifiers.sandbox_uid={uid}",
                "--config.verifiers.workers=2",
            ],
        )
        services.append(verifiers)
        inference = Service("inference", [*wired, "--config.inference.address=127.0.0.1:0"])
        services.append(inference)
        endpoints = {
            "trainer": trainer.wait_for("rlax_tpu.trainer: serving on"),
            "verifier": verifiers.wait_for("verifiers serving on"),
            "inference": inference.wait_for("rlax_tpu.inference: serving on"),
        }
        done = _controller(
            [
                *wired,
                f"--config.controller.trainer_endpoint={endpoints['trainer']}",
                f"--config.controller.verifier_endpoint={endpoints['verifier']}",
                f"--config.controller.inference_endpoints=('{endpoints['inference']}',)",
            ],
            timeout_s=300,
        )
        logs = "\n".join(f"--- {s.module}:\n{s.output()}" for s in services)
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n{logs}"
        assert "run finished: 2 updates" in done.stdout, done.stdout[-4000:]
        assert (run_dir / "report.md").is_file()
        # Same seeded init in trainer and worker: the trainer's recomputed log-probs of
        # version-0 rollouts match the worker's.
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        step1 = next(
            r["scalars"] for r in records if r["step"] == 1 and "reward/mean" in r["scalars"]
        )
        assert step1["trainer/logp_old_behaviour_diff_max"] < 1e-3, step1
        # The worker pulled the final version from the parameter server (for the last eval).
        worker = InferenceClient(endpoints["inference"])
        try:
            assert worker.status().version == 2
        finally:
            worker.close()
        # The local transport, same workload (deterministic mode): the same run, step by step.
        local_dir = tmp_path / "local"
        done = _controller(
            [
                *_workload(local_dir),
                f"--config.verifiers.sandbox_uid={uid + 4}",
                "--config.verifiers.workers=2",
            ],
            timeout_s=300,
            transport="local",
        )
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        steps = _step_record(run_dir)
        assert [s[0] for s in steps] == [1, 2] and _step_record(local_dir) == steps
        _a_component_that_stays_away_ends_the_run_in_one_line(run_dir, wired, endpoints, verifiers)
    finally:
        for s in services:
            s.terminate()
        for s in services:
            s.stop()
    # Every service stops cleanly on SIGTERM, with EXIT_STOPPED (the verifiers were killed).
    for s in services:
        assert s.proc.returncode == (-signal.SIGKILL if s is verifiers else EXIT_STOPPED), (
            f"{s.module} exited {s.proc.returncode}:\n{s.output()}"
        )


def _a_component_that_stays_away_ends_the_run_in_one_line(
    run_dir: Path, wired: list[str], endpoints: dict[str, str], verifiers: Service
) -> None:
    """The run resumed for more steps; its verifier service is SIGKILLed and not restarted: the
    controller waits controller.recovery_timeout_s for it, then stops with one line naming it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.controller",
            CONFIG,
            *wired,
            "--config.controller.transport=distributed",
            "--config.controller.num_steps=12",
            "--config.controller.recovery_timeout_s=3",
            f"--config.controller.trainer_endpoint={endpoints['trainer']}",
            f"--config.controller.verifier_endpoint={endpoints['verifier']}",
            f"--config.controller.inference_endpoints=('{endpoints['inference']}',)",
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        head = []
        for line in proc.stdout:
            head.append(line)
            if line.startswith("resuming"):
                verifiers.proc.kill()
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out = "".join(head) + out
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert f"verifiers at {endpoints['verifier']} stopped answering" in out, out[-3000:]
    assert "waiting up to 3 s for it to serve again" in out, out[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.rstrip().endswith(
        f"rlax_tpu.controller: error: verifiers at "
        f"{endpoints['verifier']} did not answer within 3 s"
    ), err[-3000:]


def _step_record(run_dir: Path) -> list[tuple]:
    """Per update: what the prompts, the sampled programs, their verdicts and the trainer's
    numerics determine (without a warm-up every program fails, so rewards and losses are 0)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = (
        "reward/mean",
        "trainer/sequence_tokens",
        "trainer/completion_tokens",
        "trainer/ratio_max",
        "trainer/param_norm",
        "trainer/logp_old_behaviour_diff_max",
    )
    verdicts = lambda sc: sorted((k, v) for k, v in sc.items() if k.startswith("verdict/"))  # noqa: E731
    return [
        (r["step"], *(r["scalars"][k] for k in keys), verdicts(r["scalars"]))
        for r in records
        if "reward/mean" in r["scalars"]
    ]


def test_unreachable_trainer_is_named(tmp_path):
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    # The parameter server (checked first) only has to accept a connection: any gRPC server.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    answering = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        t0 = time.monotonic()
        done = _controller(
            [
                f"--config.controller.run_dir={tmp_path / 'run'}",
                "--config.controller.rpc_timeout_s=3",
                f"--config.controller.param_server_endpoints=('{answering}',)",
                f"--config.controller.trainer_endpoint={closed}",
                f"--config.controller.verifier_endpoint={closed}",
                f"--config.controller.inference_endpoints=('{closed}',)",
            ],
            timeout_s=120,
        )
        elapsed = time.monotonic() - t0
    finally:
        server.stop(None)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "rlax_tpu.controller: error:" in done.stderr, done.stderr[-2000:]
    error = done.stderr.split("rlax_tpu.controller: error:", 1)[1]
    assert "trainer" in error and closed in error, error
    assert elapsed < 60, elapsed
