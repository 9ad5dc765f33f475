"""The run's topology as processes on this machine, driven by the controller as on a cluster.

Stages, each waiting for the previous one's services to print their bound address:
  0. the supervised warm-up, if the config has one and ``<run_dir>/warmup`` does not hold it yet
     (``python -m rlax_tpu.controller --warmup_out``); every later process starts from it;
  1. the parameter-server replicas;
  2. the trainer (its ``trainer.distributed.num_processes`` processes, one jax.distributed job),
     the inference workers (``inference.num_workers``, each of ``inference.distributed
     .num_processes`` processes) and the verifier service;
  3. the controller, over the distributed transport, with every endpoint filled in.
Every service listens on 127.0.0.1 on a port the OS picks. When the controller exits (or a
service dies, or this process gets SIGINT/SIGTERM) the services get SIGTERM, then SIGKILL after
a grace period, and a final sweep kills any process that still carries this launch's id in its
environment: nothing is left behind. Each process's output goes to ``<run_dir>/logs/<name>.log``
and, prefixed with its name, to this process's stdout.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from rlax_tpu import storage
from rlax_tpu.cli import tuple_value
from rlax_tpu.config import RunConfig
from rlax_tpu.config.checks import detect_accelerator
from rlax_tpu.config.libtpu import ENV as LIBTPU_ENV
from rlax_tpu.config.libtpu import libtpu_init_args

LAUNCH_ID_ENV = "RLAX_LAUNCH_ID"  # every process this launch starts carries it
READY_TIMEOUT_S = 900.0  # a service's start-up (model load and compiles) on a slow host
GRACE_S = 30.0  # SIGTERM -> SIGKILL
WARMUP_DIR = "warmup"
_ADDRESS = re.compile(r"\s*(\S+:\d+)")

# The line each service prints once it serves, and the address in it.
READY = {
    "param_server": "param_server listening on",
    "trainer": "rlax_tpu.trainer: serving on",
    "inference": "rlax_tpu.inference: serving on",
    "verifiers": "verifiers serving on",
}


class LaunchError(RuntimeError):
    """A process of the launch failed to start or died; the message says which and why."""


class Child:
    """One process of the launch: its merged output goes to a log file, to ``echo`` prefixed
    with its name, and to a queue that :meth:`wait_for` reads."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        log_dir: Path,
        echo: TextIO,
        *,
        prefix: bool = True,
        watch: Callable[[str], None] | None = None,
    ):
        """``watch``: called with every line of output (on the reader thread)."""
        self.name, self.argv, self.env, self.log_dir = name, list(argv), env, log_dir
        self._watch = watch
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "a", buffering=1)  # noqa: SIM115 - closed by the reader
        self._echo, self._prefix = echo, f"[{name}] " if prefix else ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        # Its own session: signals to this launcher's terminal do not reach it twice, and
        # stop() can signal the whole group (anything it started).
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"launch-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self.tail.append(line)
            self._echo.write(self._prefix + line)
            self._echo.flush()
            if self._watch is not None:
                self._watch(line)
            self._lines.put(line)
        self._lines.put(None)
        self._log.close()

    def wait_for(self, marker: str, deadline: float) -> str:
        """The host:port printed on this child's first line containing ``marker``."""
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise LaunchError(
                    f"{self.name} did not start within {READY_TIMEOUT_S:.0f} s "
                    f"(log: {self.log_path})"
                ) from None
            if line is None:
                raise LaunchError(
                    f"{self.name} exited with status {self.proc.wait()} before it "
                    f"served (log: {self.log_path}):\n{self.last_lines()}"
                )
            if marker in line and (m := _ADDRESS.match(line.split(marker, 1)[1])):
                return m.group(1)

    def last_lines(self, n: int = 15) -> str:
        return "".join(list(self.tail)[-n:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def join(self) -> None:
        self._reader.join(timeout=10)

    def respawn(self) -> Child:
        """The same command started again (as a restarted pod), logging to the same file."""
        return Child(
            self.name,
            self.argv,
            self.env,
            self.log_dir,
            self._echo,
            prefix=bool(self._prefix),
            watch=self._watch,
        )


class Launch:
    """Starts and stops the processes of one run (see the module docstring)."""

    def __init__(
        self,
        config: RunConfig,
        config_args: Sequence[str],
        *,
        out: TextIO = sys.stdout,
        warmup_dir: str = "",
    ):
        """``config_args``: the ``--config=...`` and ``--config.a.b=v`` flags ``config`` was
        parsed from; every process gets them, then the launch's own overrides. ``warmup_dir``:
        where the warm-up's weights are (made if missing); default ``<run_dir>/warmup``."""
        self.config, self.args, self.out = config, list(config_args), out
        self.warmup_dir = warmup_dir or storage.join(config.controller.run_dir, WARMUP_DIR)
        self.launch_id = uuid.uuid4().hex
        self.env = dict(os.environ, **{LAUNCH_ID_ENV: self.launch_id})
        self.log_dir = _log_dir(config.controller.run_dir)
        self.services: list[Child] = []
        self.controller: Child | None = None
        self._stopping = threading.Event()

    def run(self) -> int:
        """Runs the topology until the controller exits; its exit status (1 if a service died
        or failed to start)."""
        print(
            f"rlax_tpu.launch: {', '.join(self._plan())} (launch id {self.launch_id}); logs "
            f"in {self.log_dir}",
            file=self.out,
            flush=True,
        )
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            common = self._warm_up()
            if self._stopping.is_set():
                return 130
            wired = [*common, *self._start_param_servers(common)]
            endpoints = self._start_services(wired)
            if self._stopping.is_set():
                return 130
            return self._run_controller([*wired, *endpoints])
        except LaunchError as e:
            print(f"rlax_tpu.launch: error: {e}", file=self.out, flush=True)
            return 1
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)

    # -- stages ---------------------------------------------------------------------------------

    def _plan(self) -> list[str]:
        """The names of the processes this launch starts (warm-up and controller included)."""
        cfg = self.config
        names = [f"param_server-{r}" for r in range(cfg.param_server.replicas)]
        names += _group("trainer", cfg.trainer.distributed.num_processes)
        for i in range(cfg.inference.num_workers):
            names += _group(f"inference-{i}", cfg.inference.distributed.num_processes)
        names += ["verifiers", "controller"]
        return (["warmup"] if cfg.controller.warmup_steps else []) + names

    def _warm_up(self) -> list[str]:
        """Overrides every later process gets: the warmed-up weights, if there is a warm-up."""
        cc = self.config.controller
        if not cc.warmup_steps:
            return []
        out_dir = self.warmup_dir
        if not storage.path(storage.join(out_dir, "config.json")).exists():
            child = self._start(
                "warmup",
                "controller",
                ["--config.controller.transport=local", f"--warmup_out={out_dir}"],
                service=False,
            )
            while child.proc.poll() is None:  # polls: a bare wait() can miss a signal
                time.sleep(0.5)
            if child.proc.returncode != 0:
                raise LaunchError(
                    f"the warm-up exited with status {child.proc.returncode} (log: "
                    f"{child.log_path}):\n{child.last_lines()}"
                )
        else:
            print(f"rlax_tpu.launch: reusing the warm-up in {out_dir}", file=self.out, flush=True)
        return [
            "--config.model.weights_format=safetensors",
            f"--config.model.weights_path={out_dir}",
            # The warmed-up model keeps the prompt format it was trained on.
            f"--config.data.prompt_style={self.config.prompt_style}",
            "--config.controller.warmup_steps=0",
        ]

    def _start_param_servers(self, common: list[str]) -> list[str]:
        replicas = self.config.param_server.replicas
        children = [
            self._start(
                f"param_server-{r}",
                "param_server",
                [
                    *common,
                    f"--config.param_server.address={self._address(f'param_server-{r}')}",
                    f"--config.param_server.replica_index={r}",
                ],
            )
            for r in range(replicas)
        ]
        endpoints = [self._ready(c, READY["param_server"]) for c in children]
        return [f"--config.controller.param_server_endpoints={tuple_value(endpoints)}"]

    def _start_services(self, wired: list[str]) -> list[str]:
        cfg = self.config
        trainer_procs = _group("trainer", cfg.trainer.distributed.num_processes)
        trainer_lead = self._start_group(
            trainer_procs, "trainer", "trainer", wired, slices=cfg.mesh.slices
        )
        workers = []
        for i in range(cfg.inference.num_workers):
            extra = [f"--config.inference.worker_index={i}"]
            procs = _group(f"inference-{i}", cfg.inference.distributed.num_processes)
            workers.append(self._start_group(procs, "inference", "inference", [*wired, *extra]))
        verifiers = self._start(
            "verifiers",
            "verifiers",
            [*wired, f"--config.verifiers.address={self._address('verifiers')}"],
        )
        trainer = self._ready(trainer_lead, READY["trainer"])
        inference = [self._ready(w, READY["inference"]) for w in workers]
        verifier = self._ready(verifiers, READY["verifiers"])
        return [
            f"--config.controller.trainer_endpoint={trainer}",
            f"--config.controller.inference_endpoints={tuple_value(inference)}",
            f"--config.controller.verifier_endpoint={verifier}",
        ]

    def _start_group(
        self, names: list[str], module: str, section: str, args: list[str], *, slices: int = 1
    ) -> Child:
        """The processes of one jax.distributed job (one, or a coordinator on a free local port
        and a process id each); returns process 0, the one that serves. Over ``slices`` slices
        each process gets its slice and its index within it, as a GKE pod of a multislice
        JobSet does (launch/gke.py), so the emulation takes the cluster's path."""
        args = [*args, f"--config.{section}.address={self._address(names[0].split('.')[0])}"]
        if len(names) == 1:
            return self._start(names[0], module, args)
        coordinator = f"127.0.0.1:{free_port()}"
        per_slice = len(names) // slices
        children = [
            self._start(
                name,
                module,
                [
                    *args,
                    f"--config.{section}.distributed.coordinator_address={coordinator}",
                    f"--config.{section}.distributed.num_processes={len(names)}",
                    f"--config.{section}.distributed.process_id={pid % per_slice}",
                    *(
                        [f"--config.{section}.distributed.slice_index={pid // per_slice}"]
                        if slices > 1
                        else []
                    ),
                ],
            )
            for pid, name in enumerate(names)
        ]
        return children[0]

    def _address(self, name: str) -> str:
        """Where service ``name`` (a group's name for a jax.distributed job) listens: a port the
        OS picks."""
        return "127.0.0.1:0"

    def _run_controller(self, args: list[str]) -> int:
        self.controller = self._start_controller(args)
        while self.controller.proc.poll() is None:
            dead = next((s for s in self.services if s.proc.poll() is not None), None)
            if dead is not None and not self._stopping.is_set():
                print(
                    f"rlax_tpu.launch: error: {dead.name} exited with status "
                    f"{dead.proc.returncode} during the run (log: {dead.log_path}); stopping",
                    file=self.out,
                    flush=True,
                )
                self.controller.signal(signal.SIGTERM)
                self.controller.proc.wait()
                return 1
            time.sleep(0.5)
        return self.controller.proc.returncode

    def _start_controller(
        self, args: list[str], watch: Callable[[str], None] | None = None
    ) -> Child:
        return self._start(
            "controller",
            "controller",
            [*args, "--config.controller.transport=distributed"],
            service=False,
            prefix=False,
            watch=watch,
        )

    # -- processes ------------------------------------------------------------------------------

    def _env(self, module: str) -> dict[str, str]:
        """A child's environment: on a TPU host, a process that runs on the TPUs gets the XLA
        flags the AOT check compiles with (config/libtpu.py), unless the environment has its
        own; elsewhere none (JAX keys its compilation cache on them, CPU programs too)."""
        on_tpu = {"trainer": "trainer", "inference": "inference", "controller": "trainer"}
        component = on_tpu.get(module)
        if component is None or detect_accelerator() != "tpu":
            return self.env
        if module == "controller" and self.config.controller.transport != "local":
            return self.env
        flags = libtpu_init_args(self.config, component)
        return self.env if not flags else {LIBTPU_ENV: flags} | self.env

    def _start(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        service: bool = True,
        prefix: bool = True,
        watch: Callable[[str], None] | None = None,
    ) -> Child:
        argv = [sys.executable, "-m", f"rlax_tpu.{module}", *self.args, *args]
        child = Child(
            name, argv, self._env(module), self.log_dir, self.out, prefix=prefix, watch=watch
        )
        if service:
            self.services.append(child)
        return child

    def _ready(self, child: Child, marker: str) -> str:
        address = child.wait_for(marker, time.monotonic() + READY_TIMEOUT_S)
        print(f"rlax_tpu.launch: {child.name} serves on {address}", file=self.out, flush=True)
        return address

    def _on_signal(self, signum: int, _frame: object) -> None:
        print(
            f"rlax_tpu.launch: {signal.Signals(signum).name}: stopping every process",
            file=self.out,
            flush=True,
        )
        self._stopping.set()
        if self.controller is not None:
            self.controller.signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to every process (the controller first), SIGKILL after GRACE_S, then a sweep
        of anything left that carries this launch's id."""
        children = ([self.controller] if self.controller else []) + self.services
        for child in children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for child in children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"rlax_tpu.launch: {child.name} did not stop within {GRACE_S:.0f} s; killed",
                    file=self.out,
                    flush=True,
                )
                child.signal(signal.SIGKILL)
                child.proc.wait()
            child.join()
        left = kill_launched(self.launch_id)
        if left:
            print(
                f"rlax_tpu.launch: killed {len(left)} leftover processes {left}",
                file=self.out,
                flush=True,
            )


def launched_pids(launch_id: str) -> list[int]:
    """Pids of live processes whose environment carries ``launch_id`` (this process excluded)."""
    needle = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def kill_launched(launch_id: str) -> list[int]:
    """SIGKILLs every live process carrying ``launch_id``; the pids it found."""
    pids = launched_pids(launch_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _group(name: str, processes: int) -> list[str]:
    return [name] if processes == 1 else [f"{name}.{p}" for p in range(processes)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_dir(run_dir: str) -> Path:
    if storage.is_remote(run_dir):
        return Path(tempfile.mkdtemp(prefix="rlax-launch-logs-"))
    path = Path(run_dir) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path
