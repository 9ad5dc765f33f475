"""A preemption drill: the launcher's topology with seeded SIGKILLs and restarts.

Every service listens on a port fixed for the drill, so a restarted process serves where the
controller expects it (as a Kubernetes Service keeps its name). Kills come one at a time: after
the run has completed a step since the previous recovery, a seeded fraction of a step later, a
seeded component (controller, trainer, an inference worker, a parameter-server replica, the
verifier service) gets SIGKILL with its whole process group (a jax.distributed job dies as a
slice does); after a seeded delay the same command starts again. Recovery is the time from that
restart to the next step the controller completes. A process that exits without being killed is
restarted too (a pod's restart policy) and counted as unplanned.

A target can also be one follower process of a multi-process (jax.distributed) component,
``trainer.<p>`` or ``inference-<i>.<p>`` with p >= 1: only that process gets SIGKILL, and the rest
of its job must end on its own (rlax_tpu.multihost's failure rule) within GROUP_END_BOUND_S. The
drill records how long that took (``Kill.group_end_s``) and SIGKILLs any process that outlives
the bound (``Kill.outlived``); then it restarts the whole job, as a JobSet restarts a multi-host
job. Those exits were planned, not counted as unplanned.
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
from typing import TYPE_CHECKING, TextIO

from rlax_tpu.config import RunConfig
from rlax_tpu.launch.local import Child, Launch, free_port

if TYPE_CHECKING:
    from rlax_tpu.drills.checks import Check

KINDS = ("controller", "trainer", "inference", "param_server", "verifiers")
_STEP = re.compile(r"^step (\d+)/(\d+)")
RESTART_DELAY_S = (0.5, 2.0)
MAX_UNPLANNED = 5
# A follower's death ends its whole job within distributed.heartbeat_timeout_s (20 s) plus the
# detection (rlax_tpu.multihost's failure rule).
GROUP_END_BOUND_S = 30.0


@dataclasses.dataclass
class Kill:
    """One planned kill and what followed it (times in seconds since the drill started)."""

    # A process group (controller, trainer, inference-<i>, param_server-<r>, verifiers) or one
    # follower process of a multi-process group (trainer.<p>, inference-<i>.<p>, p >= 1).
    target: str
    fraction: float  # of a step time after the step that triggers it
    restart_delay_s: float
    at_step: int = -1  # the newest completed step when it hit
    killed_at: float = float("nan")
    restarted_at: float = float("nan")
    recovered_at: float = float("nan")  # first completed step after the restart
    resumed_step: int = -1  # that step's number
    # A process target only (NaN / empty otherwise): seconds from the kill until the last other
    # process of its job had ended; the processes still running GROUP_END_BOUND_S after the kill
    # (then SIGKILLed); how each other process ended.
    group_end_s: float = float("nan")
    outlived: list[str] = dataclasses.field(default_factory=list)
    group_exits: list[str] = dataclasses.field(default_factory=list)

    @property
    def kind(self) -> str:
        return kind_of(self.target)

    @property
    def group(self) -> str:
        return group_of(self.target)

    @property
    def is_process(self) -> bool:
        """Whether the target is one process of a multi-process group, not a whole group."""
        return self.target != self.group

    @property
    def recover_s(self) -> float:
        return self.recovered_at - self.restarted_at


def kind_of(target: str) -> str:
    """The component kind of a target: ``inference-0.1`` -> ``inference``."""
    return group_of(target).split("-")[0]


def group_of(target: str) -> str:
    """The process group a target belongs to: ``trainer.1`` -> ``trainer`` (a group: itself)."""
    return target.split(".")[0]


def plan(targets: Sequence[str], kills: int, seed: int) -> list[Kill]:
    """``kills`` kills over ``targets`` (process-group or process names), seeded: every kind
    present is hit once before any is hit twice (a drill of >= 5 kills hits each), in a seeded
    order; a kind's target is drawn from all of its targets, single processes included."""
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
                + (
                    f"(SIGKILL of one process of {kill.group}; the rest of it must end within "
                    f"{GROUP_END_BOUND_S:.0f} s; restart in {kill.restart_delay_s:.1f} s)"
                    if kill.is_process
                    else f"(SIGKILL; restart in {kill.restart_delay_s:.1f} s)"
                )
            )
            if kill.is_process:
                self._await_group_end(kill)
            time.sleep(kill.restart_delay_s)
            self._restart(kill.group)
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
        return [i for i, c in enumerate(self.services) if group_of(c.name) == target]

    def _kill(self, kill: Kill) -> None:
        with self._cond:
            kill.at_step = max((s for _, s in self.steps), default=0)
        kill.killed_at = self._now()
        if kill.target == "controller":
            children = [self.controller]
        elif kill.is_process:
            children = [c for c in self.services if c.name == kill.target]
            if not children:
                raise ValueError(f"no process {kill.target} in this launch")
        else:
            children = [self.services[i] for i in self._group(kill.target)]
        for child in children:
            if child is not None:
                child.signal(signal.SIGKILL)
        for child in children:
            if child is not None:
                child.proc.wait()

    def _await_group_end(self, kill: Kill) -> None:
        """After one process of a group was killed: waits for the group's other processes to
        end on their own (up to GROUP_END_BOUND_S after the kill), recording when and how they
        ended; SIGKILLs (and records) any that outlive the bound."""
        rest = [self.services[i] for i in self._group(kill.group)]
        rest = [c for c in rest if c.name != kill.target]
        ended: dict[str, float] = {}
        deadline = kill.killed_at + GROUP_END_BOUND_S
        while True:
            for c in rest:
                if c.name not in ended and c.proc.poll() is not None:
                    ended[c.name] = self._now() - kill.killed_at
            if len(ended) == len(rest) or self._now() >= deadline:
                break
            time.sleep(0.1)
        for c in rest:
            if c.name in ended:
                kill.group_exits.append(
                    f"{c.name} status {c.proc.returncode} after {ended[c.name]:.1f} s"
                )
            else:
                kill.outlived.append(c.name)
                c.signal(signal.SIGKILL)
                c.proc.wait()
        if kill.outlived:
            self._say(
                f"{kill.group}: {', '.join(kill.outlived)} still ran {GROUP_END_BOUND_S:.0f} s "
                f"after {kill.target} was killed; SIGKILLed"
            )
        else:
            kill.group_end_s = max(ended.values(), default=0.0)
            self._say(
                f"{kill.group}: the rest of the job ended {kill.group_end_s:.1f} s after "
                f"{kill.target} was killed ({'; '.join(kill.group_exits)})"
            )

    def _restart(self, target: str) -> None:
        if target == "controller":
            self.controller = self._restart_controller()
            return
        for i in self._group(target):
            old = self.services[i]
            old.join()
            self.services[i] = old.respawn()

    def _restart_dead_services(self) -> None:
        for target in {group_of(c.name) for c in self.services if c.proc.poll() is not None}:
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
    """What a drill can kill in ``config``'s topology: every process group, and every follower
    process (p >= 1, named as the launcher names them) of a multi-process trainer or inference
    worker."""
    out = ["controller", "trainer", "verifiers"]
    out += _followers("trainer", config.trainer.distributed.num_processes)
    for i in range(config.inference.num_workers):
        out += [f"inference-{i}"]
        out += _followers(f"inference-{i}", config.inference.distributed.num_processes)
    out += [f"param_server-{r}" for r in range(config.param_server.replicas)]
    return out


def _followers(group: str, processes: int) -> list[str]:
    return [f"{group}.{p}" for p in range(1, processes)]


def describe(kills: Sequence[Kill]) -> list[str]:
    """One line per kill (for the drill's report)."""
    return [
        f"{i + 1:>3}. {k.target:<16} at step {k.at_step:>3}, t={k.killed_at:7.1f} s; "
        + (_group_end(k) if k.is_process else "")
        + f"restarted after {k.restart_delay_s:.1f} s; "
        + (
            f"recovered in {k.recover_s:.1f} s (step {k.resumed_step})"
            if k.recovered_at == k.recovered_at
            else "did not recover"
        )
        for i, k in enumerate(kills)
        if k.killed_at == k.killed_at
    ]


def _group_end(k: Kill) -> str:
    if k.outlived:
        return f"{', '.join(k.outlived)} outlived {GROUP_END_BOUND_S:.0f} s (SIGKILLed); "
    return f"its job ended in {k.group_end_s:.1f} s; "


GROUP_END_CHECK = f"a killed process ended its whole job within {GROUP_END_BOUND_S:.0f} s"


def group_end_check(kills: Sequence[Kill]) -> Check:
    """Every kill of one process of a multi-process job: the rest of the job ended on its own
    within GROUP_END_BOUND_S (ok, and saying so, when the drill killed no single process)."""
    from rlax_tpu.drills.checks import Check  # noqa: F811 - heavy imports, only when used

    hit = [k for k in kills if k.is_process and k.killed_at == k.killed_at]
    if not hit:
        return Check(
            GROUP_END_CHECK,
            True,
            "vacuous: no kill hit one process of a multi-process job in this drill",
        )
    late = [k for k in hit if k.outlived]
    return Check(
        GROUP_END_CHECK,
        not late,
        "; ".join(
            f"{k.target}: "
            + (
                f"{', '.join(k.outlived)} outlived the bound"
                if k.outlived
                else f"its job ended in {k.group_end_s:.1f} s"
            )
            for k in hit
        ),
    )
