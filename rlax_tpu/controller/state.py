"""The controller's state: snapshots (written before each update), resume from the newest
usable one, compatibility of a resumed config, and the versions the parameter server must hold."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rlax_tpu.config import RunConfig, diff, from_dict, to_dict
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.controller.ledger import Ledger
from rlax_tpu.controller.snapshots import SnapshotStore
from rlax_tpu.data.mixture import PromptRef
from rlax_tpu.trainer import CorruptCheckpointError

log = logging.getLogger(__name__)

# Fields a resumed run may change; any other difference is an incompatible config.
RESUMABLE_FIELDS = (
    "controller.num_steps",
    "controller.log_every",
    "controller.rpc_timeout_s",
    "controller.recovery_timeout_s",
    "controller.stop_grace_s",
    "controller.compilation_cache",
    "controller.snapshot_keep",
    "trainer.keep_checkpoints",
    "trainer.publish_in_flight",  # when a version reaches the workers, not what it is
    "controller.transport",
    "controller.trainer_process",
    "controller.trainer_cpus",
    "controller.inference_endpoints",
    "controller.verifier_endpoint",
    "controller.trainer_endpoint",
    "controller.param_server_endpoints",
    "controller.auth_token_file",
    "controller.run_dir",
    "data.eval_every",
    "data.eval_share",
    "environment.schedule",  # the same samples either way (lock-step where rows are not bitwise)
    "environment.concurrency",
    "data.data_dir",
    "inference.num_workers",
    "inference.address",
    "trainer.address",
    "trainer.precompile",
    "verifiers.address",
    "verifiers.python_check",
    "param_server.address",
    "verifiers.workers",
    "verifiers.sandbox_uid",
)


class IncompatibleResume(ValueError):
    """The run directory holds a run with a different config."""


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_compatible(config: RunConfig, saved: dict[str, Any], run_dir: object) -> None:
    """IncompatibleResume if ``saved`` (a snapshot's config, as a dict) differs from ``config``
    in a field a resume cannot change."""
    old = from_dict(type(config), saved)
    differing = [f for f in diff(old, config) if f not in RESUMABLE_FIELDS]
    if differing:
        raise IncompatibleResume(
            f"{run_dir} holds a run with a different config: "
            + ", ".join(f"{f} (run: {_get(old, f)!r}, now: {_get(config, f)!r})" for f in differing)
            + "; use another controller.run_dir or the run's config"
        )


def refuse_incompatible(config: RunConfig, snapshots: SnapshotStore, run_dir: object) -> None:
    """Before any component is built (a model load takes minutes at pod scale): the check a
    resume makes on the newest readable snapshot of ``snapshots``. An unreadable one is left
    to the resume, which warns and skips it."""
    for step in reversed(snapshots.steps()):
        try:
            saved = json.loads(snapshots.load(step)["json"])["config"]
        except Exception:  # noqa: BLE001, S112 - the resume names it
            continue
        check_compatible(config, saved, run_dir)
        return


@dataclasses.dataclass
class Counters:
    groups_trained: int = 0
    groups_discarded_stale: int = 0
    groups_filtered: int = 0
    groups_refilled: int = 0  # drawn by dynamic sampling's extra rounds
    groups_surplus: int = 0  # kept by the filter beyond prompts_per_step, discarded
    updates_skipped: int = 0  # nothing to learn: every group filtered
    groups_replayed: int = 0  # data.replay: groups drawn from the buffer and trained on
    skipped_in_a_row: int = 0
    groups_verifier_failed: int = 0
    tokens_generated: int = 0
    prompts_too_long: int = 0  # drawn from the mixture but longer than inference.max_prompt_len
    last_eval_version: int = -1


class StateMixin:
    """Controller methods: snapshots, resume and the versions kept (see loop.Controller)."""

    def _payload(self, replay: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "config": to_dict(self.config),
            "step": self.step,
            "version": self.version,
            "mixture": self.mixture.state(),
            "ledger": self.ledger.live_state(),
            "ledger_segments": self.ledger_segments,
            "refs": {k: dataclasses.asdict(r) for k, r in self.refs.items()},
            "buffered": {k: self._split[k][0] for k in self.buffered},
            "counters": dataclasses.asdict(self.counters),
            "evals": {str(v): m for v, m in self.evals.items()},
            "evals_in_flight": self.background_evals.pending(),
            "done": self.step >= self.cc.num_steps,
        } | ({"replay": replay} if replay is not None else {})

    def snapshot(self) -> None:
        closed = self.ledger.take_closed()
        if closed:  # before the snapshot that counts it
            self.ledger_log.write(self.ledger_segments, closed)
            self.ledger_segments += 1
        self._split = {k: g.split_state() for k, g in self.buffered.items()}
        replay = None
        if self.replay is not None:
            self.replay.flush()
            replay = self.replay.state()
        # The state as JSON (the mixture's RNG state holds 128-bit ints msgpack cannot carry),
        # the buffered rollouts as arrays beside it.
        self.snapshots.save(
            self.step,
            {
                "json": json.dumps(self._payload(replay)),
                "rollouts": {k: a for k, (_, a) in self._split.items()},
            },
        )
        if self.replay is not None:
            self.replay.collect(self.step, self.snapshots.steps(), replay)

    def check_compatible(self, saved: dict[str, Any]) -> None:
        check_compatible(self.config, saved, self.run_dir)

    def restore(self) -> bool:
        """Loads the newest snapshot that has a trainer checkpoint; False for a fresh run."""
        status = self.c.trainer.status()
        checkpoints = set(status.checkpoint_steps)
        # A trainer that outlived the controller and holds a snapshot's version already has
        # that checkpoint's state in memory: no restore, and no need for the checkpoint. (Not
        # at step 0: a new trainer holds its initial weights there, which a run with a
        # warm-up replaced in checkpoint 0.)
        live = int(status.step) if status.step > 0 and not status.halted else None
        for step, payload in self._snapshots_newest_first():
            if int(payload["version"]) == live:
                self._load(payload)
                return True
            if int(payload["version"]) not in checkpoints:
                self._warn(
                    f"snapshot {step} needs trainer checkpoint {payload['version']}, which "
                    "is missing or incomplete; trying an older snapshot"
                )
                continue
            try:
                self.c.trainer.restore(int(payload["version"]))
            except CorruptCheckpointError as e:
                self._warn(
                    f"snapshot {step} needs trainer checkpoint {payload['version']}, which "
                    f"is corrupt and was removed ({e}); trying an older snapshot"
                )
                continue
            self._load(payload)
            return True
        self._no_usable_snapshot()
        return False

    def newest_restorable_version(self) -> int | None:
        """The version a resume would restore (the newest snapshot whose trainer checkpoint is
        complete), read without changing anything (``restore`` also truncates the ledger and
        replay logs to that snapshot); None for a run with no snapshot."""
        checkpoints = set(self.c.trainer.status().checkpoint_steps)
        for _, payload in self._snapshots_newest_first():
            if int(payload["version"]) in checkpoints:
                return int(payload["version"])
        self._no_usable_snapshot()
        return None

    def _snapshots_newest_first(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, payload) of every readable snapshot, newest first (unreadable ones warned and
        skipped); IncompatibleResume for one of another config."""
        for step in reversed(self.snapshots.steps()):
            try:
                loaded = self.snapshots.load(step)
                payload = json.loads(loaded["json"]) | {"_arrays": loaded.get("rollouts", {})}
            except Exception as e:
                self._warn(f"skipping unreadable snapshot {step}: {e}")
                continue
            self.check_compatible(payload["config"])
            yield step, payload

    def _no_usable_snapshot(self) -> None:
        """Raises if the run has snapshots (none of them usable, see the warnings)."""
        if self.snapshots.steps():
            raise RuntimeError(f"no usable snapshot in {self.snapshots.dir} (see warnings)")

    def _load(self, p: dict[str, Any]) -> None:
        self.step, self.version = int(p["step"]), int(p["version"])
        self.mixture.restore(p["mixture"])
        self.ledger = Ledger.from_state(p["ledger"])
        self.refs = {k: PromptRef(**v) for k, v in p["refs"].items()}
        arrays = p.get("_arrays", {})
        self.buffered = {
            k: groups_lib.GroupResult.from_split(v, arrays[k])
            if k in arrays
            else groups_lib.GroupResult.from_state(v)  # a snapshot from before
            for k, v in p["buffered"].items()
        }
        self.ledger_segments = int(p.get("ledger_segments", 0))
        self.ledger_log.truncate(self.ledger_segments)
        if "ledger_segments" not in p:  # a snapshot from before segments: its finished groups
            old = [r for r in p["ledger"] if r["state"] in ("trained", "discarded")]
            if old:
                self.ledger_log.write(0, old)
                self.ledger_segments = 1
        # Snapshots from before a counter was dropped (e.g. warmup_ran) still load.
        known = {f.name for f in dataclasses.fields(Counters)}
        self.counters = Counters(**{k: v for k, v in p["counters"].items() if k in known})
        if self.replay is not None:
            self.replay.restore(p["replay"])
        self.evals = {int(v): dict(m) for v, m in p["evals"].items()}
        self._evals_in_flight = [int(v) for v in p.get("evals_in_flight", [])]

    def ensure_versions(self, versions: Sequence[int]) -> None:
        """Every version in ``versions`` is on the parameter server (republished from trainer
        checkpoints if the server lost it)."""
        hot, _ = self.c.param_server.list_versions()
        have = {v.version for v in hot}
        # With the evaluations a resumed run starts again: one ascending pass (the server
        # takes only versions newer than its newest).
        missing = sorted((set(versions) | set(self._evals_in_flight)) - have)
        if not missing:
            self._restart_evals()
            return
        current = at = self.c.trainer.status().step
        try:
            for v in missing:
                self._event(f"publishing version {v} (the parameter server does not have it)")
                if v != at:
                    at = self.c.trainer.restore(v)
                self.c.trainer.publish()
        finally:  # the trainer goes on from its own version whatever failed
            if at != current:
                self.c.trainer.restore(current)
        self._restart_evals()

    def lease(self, versions: Iterable[int], *, consumer: str = "controller") -> None:
        """Has the parameter server keep ``versions`` for ``consumer`` (replacing its set;
        an evaluation beside training holds its version as "evaluation")."""
        versions = list(versions)
        if not versions and consumer == "controller":
            return
        try:
            self.c.param_server.lease(consumer, sorted(set(versions)))
        except Exception as e:  # a lease is an optimization of GC, not needed for correctness
            self._warn(f"leasing versions {sorted(set(versions))} failed: {e}")
