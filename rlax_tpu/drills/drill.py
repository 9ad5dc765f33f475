"""A preemption drill: the launcher's topology with seeded SIGKILLs and restarts.

Every service listens on a port fixed for the drill, so a restarted process serves where the
controller expects it (as a Kubernetes Service keeps its name). Kills come one at a time: after
the run has completed a step since the previous recovery, a seeded fraction of a step later, a
seeded component (controller, trainer, an inference worker, a parameter-server replica, the
verifier service) gets SIGKILL with its whole process group (a jax.distributed job dies as a
slice does); after a seeded delay the same command starts again. Recovery is the time from that
restart to the next step the controller completes. A process that exits without being killed is
restarted too (a pod's restart policy) and counted as unplanned.
"""

from __future__ import annotations

import dataclasses
import random
import re
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from rlax_tpu.config import RunConfig
from rlax_tpu.launch.local import Child, Launch, free_port

KINDS = ("controller", "trainer", "inference", "param_server", "verifiers")
_STEP = re.compile(r"^step (\d+)/(\d+)")
RESTART_DELAY_S = (0.5, 2.0)
MAX_UNPLANNED = 5


@dataclasses.dataclass
class Kill:
    """One planned kill and what followed it (times in seconds since the drill started)."""

    target: str  # a process group: controller, trainer, inference-<i>, param_server-<r>, verifiers
    fraction: float  # of a step time after the step that triggers it
    restart_delay_s: float
    at_step: int = -1  # the newest completed step when it hit
    killed_at: float = float("nan")
    restarted_at: float = float("nan")
    recovered_at: float = float("nan")  # first completed step after the restart
    resumed_step: int = -1  # that step's number

    @property
    def kind(self) -> str:
        return kind_of(self.target)

    @property
    def recover_s(self) -> float:
        return self.recovered_at - self.restarted_at


def kind_of(target: str) -> str:
    return target.split("-")[0]


def plan(targets: Sequence[str], kills: int, seed: int) -> list[Kill]:
    """``kills`` kills over ``targets`` (process-group names), seeded: every kind present is hit
    once before any is hit twice (a drill of >= 5 kills hits each), in a seeded order."""
    rng = random.Random(seed)
    by_kind = {k: [t for t in targets if kind_of(t) == k] for k in KINDS}
    kinds = [k for k in KINDS if by_kind[k]]
    order: list[str] = []
    while len(order) < kills:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    return [
        Kill(
            target=rng.choice(by_kind[k]),
            fraction=rng.random(),
            restart_delay_s=rng.uniform(*RESTART_DELAY_S),
        )
        for k in order[:kills]
    ]


class DrillLaunch(Launch):
    """:class:`Launch` on fixed ports whose controller stage carries out a kill plan."""

    def __init__(
        self,
        config: RunConfig,
        config_args: Sequence[str],
        kills: list[Kill],
        *,
        out: TextIO,
        warmup_dir: str = "",
        recovery_limit_s: float = 900.0,
    ):
        super().__init__(config, config_args, out=out, warmup_dir=warmup_dir)
        self.kills = kills
        self.recovery_limit_s = recovery_limit_s
        self.unplanned: list[str] = []
        self.steps: list[tuple[float, int]] = []  # (time, step) of every completed step seen
        self._ports: dict[str, str] = {}
        self._cond = threading.Condition()
        self._t0 = time.monotonic()

    def _address(self, name: str) -> str:
        if name not in self._ports:
            self._ports[name] = f"127.0.0.1:{free_port()}"
        return self._ports[name]

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _on_controller_line(self, line: str) -> None:
        if m := _STEP.match(line.strip()):
            with self._cond:
                self.steps.append((self._now(), int(m.group(1))))
                self._cond.notify_all()

    def _say(self, text: str) -> None:
        print(f"rlax_tpu.drills: {text}", file=self.out, flush=True)

    # -- the controller stage -------------------------------------------------------------------

    def _run_controller(self, args: list[str]) -> int:
        self._controller_args = args
        self.controller = self._restart_controller()
        since = 0.0
        for i, kill in enumerate(self.kills):
            if not self._wait_step_after(since) or self._stopping.is_set():
                self._say(f"the run ended before kill {i + 1} of {len(self.kills)}")
                break
            time.sleep(kill.fraction * self.median_step_s(default=1.0))
            if self.controller.proc.poll() is not None:
                self._say(f"the run ended before kill {i + 1} of {len(self.kills)}")
                break
            self._kill(kill)
            self._say(
                f"kill {i + 1}/{len(self.kills)}: {kill.target} at step {kill.at_step} "
                f"(SIGKILL; restart in {kill.restart_delay_s:.1f} s)"
            )
            time.sleep(kill.restart_delay_s)
            self._restart(kill.target)
            kill.restarted_at = self._now()
            if self._wait_step_after(kill.restarted_at, limit_s=self.recovery_limit_s):
                kill.recovered_at, kill.resumed_step = self._first_step_after(kill.restarted_at)
                self._say(
                    f"{kill.target} recovered: step {kill.resumed_step} completed "
                    f"{kill.recover_s:.1f} s after the restart"
                )
            elif self.controller.proc.poll() == 0:
                kill.recovered_at, kill.resumed_step = self._now(), kill.at_step
                self._say(f"{kill.target}: the run had finished")
            else:
                self._say(
                    f"{kill.target}: no step within {self.recovery_limit_s:.0f} s of the "
                    "restart; stopping the drill"
                )
                return 1
            since = kill.recovered_at
        while True:  # the rest of the run; unplanned exits restarted, as a pod's would be
            code = self.controller.proc.wait()
            if code == 0 or self._stopping.is_set() or not self._unplanned("controller", code):
                return code
            self.controller = self._restart_controller()

    def _restart_controller(self) -> Child:
        return self._start_controller(self._controller_args, watch=self._on_controller_line)

    def _wait_step_after(self, t: float, *, limit_s: float | None = None) -> bool:
        """Waits for a step completed after time ``t`` while restarting services that die on
        their own; False if the controller exits first or ``limit_s`` passes."""
        deadline = time.monotonic() + (limit_s if limit_s is not None else self.recovery_limit_s)
        while time.monotonic() < deadline and not self._stopping.is_set():
            with self._cond:
                if any(when > t for when, _ in self.steps):
                    return True
                self._cond.wait(timeout=0.5)
            self._restart_dead_services()
            code = self.controller.proc.poll() if self.controller else 0
            if code is not None:
                if code == 0 or not self._unplanned("controller", code):
                    return False
                self.controller = self._restart_controller()
        return False

    def _first_step_after(self, t: float) -> tuple[float, int]:
        with self._cond:
            return next((w, s) for w, s in self.steps if w > t)

    def median_step_s(self, default: float = float("nan")) -> float:
        """Median time between the completed steps seen (``default`` before two)."""
        with self._cond:
            times = [b[0] - a[0] for a, b in zip(self.steps, self.steps[1:], strict=False)]
        return statistics.median(times) if times else default

    # -- processes ------------------------------------------------------------------------------

    def _group(self, target: str) -> list[int]:
        """Indices in self.services of the processes of group ``target``."""
        return [i for i, c in enumerate(self.services) if c.name.split(".")[0] == target]

    def _kill(self, kill: Kill) -> None:
        with self._cond:
            kill.at_step = max((s for _, s in self.steps), default=0)
        kill.killed_at = self._now()
        children = (
            [self.controller]
            if kill.target == "controller"
            else [self.services[i] for i in self._group(kill.target)]
        )
        for child in children:
            if child is not None:
                child.signal(signal.SIGKILL)
        for child in children:
            if child is not None:
                child.proc.wait()

    def _restart(self, target: str) -> None:
        if target == "controller":
            self.controller = self._restart_controller()
            return
        for i in self._group(target):
            old = self.services[i]
            old.join()
            self.services[i] = old.respawn()

    def _restart_dead_services(self) -> None:
        for target in {c.name.split(".")[0] for c in self.services if c.proc.poll() is not None}:
            group = [self.services[i] for i in self._group(target)]
            code = next(c.proc.returncode for c in group if c.proc.poll() is not None)
            if not self._unplanned(target, code):
                self._stopping.set()
                return
            for c in group:
                c.signal(signal.SIGKILL)
                c.proc.wait()
            self._restart(target)

    def _unplanned(self, target: str, code: int) -> bool:
        """Records an exit nobody planned; whether to restart it (up to MAX_UNPLANNED)."""
        self.unplanned.append(f"{target} exited with status {code} at {self._now():.1f} s")
        self._say(f"UNPLANNED: {self.unplanned[-1]}; restarting it")
        return len(self.unplanned) <= MAX_UNPLANNED


def targets_of(config: RunConfig) -> list[str]:
    """The process groups a drill can kill in ``config``'s topology."""
    out = ["controller", "trainer", "verifiers"]
    out += [f"inference-{i}" for i in range(config.inference.num_workers)]
    out += [f"param_server-{r}" for r in range(config.param_server.replicas)]
    return out


def describe(kills: Sequence[Kill]) -> list[str]:
    """One line per kill (for the drill's report)."""
    return [
        f"{i + 1:>3}. {k.target:<16} at step {k.at_step:>3}, t={k.killed_at:7.1f} s; restarted "
        f"after {k.restart_delay_s:.1f} s; "
        + (
            f"recovered in {k.recover_s:.1f} s (step {k.resumed_step})"
            if k.recovered_at == k.recovered_at
            else "did not recover"
        )
        for i, k in enumerate(kills)
        if k.killed_at == k.killed_at
    ]
