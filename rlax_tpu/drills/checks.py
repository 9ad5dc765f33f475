"""What a drill checks once its run has finished, from the run directory alone (and, in
deterministic mode, an uninterrupted reference run of the same config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rlax_tpu.config import RunConfig
from rlax_tpu.controller.snapshots import SnapshotStore, full_ledger
from rlax_tpu.observability.metrics import read_metrics
from rlax_tpu.param_server.persistence import Persister
from rlax_tpu.trainer.checkpoint import inspect_checkpoints

# Lines in any process's log that mean a reader got bytes that were not a whole version.
PARTIAL_VERSION_SIGNS = ("checksum mismatch", "DataLoss", "DATA_LOSS")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class RunState:
    """What a finished run left: its final snapshot and the digest of its final checkpoint."""

    payload: dict[str, Any]  # the newest snapshot
    final_sha256: str  # of the trainer checkpoint at the final version ("" if none)
    checkpoints: list[Any]  # CheckpointReport per checkpoint on disk
    train_steps: list[int]  # steps of the update records read_metrics gives, in logged order


def read_run(run_dir: Path, config: RunConfig) -> RunState:
    store = SnapshotStore(run_dir / "snapshots", keep=config.controller.snapshot_keep)
    newest = store.latest()
    payload = json.loads(newest[1]["json"]) if newest else {}
    if payload:
        payload["ledger"] = full_ledger(run_dir, payload)
    reports = inspect_checkpoints(run_dir / "trainer")
    final = next((r.sha256 for r in reports if r.step == payload.get("version") and r.complete), "")
    steps = [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r["scalars"]]
    return RunState(payload=payload, final_sha256=final, checkpoints=reports, train_steps=steps)


def check_run(run_dir: Path, config: RunConfig, reference: RunState | None) -> list[Check]:
    """Every check of a drill on ``run_dir`` (``reference``: deterministic mode's uninterrupted
    run, for the bitwise comparisons)."""
    state = read_run(run_dir, config)
    cc = config.controller
    p = state.payload
    out = [
        Check(
            "run finished",
            bool(p.get("done")) and p.get("step") == cc.num_steps,
            f"step {p.get('step')} of {cc.num_steps}",
        )
    ]
    want = list(range(1, cc.num_steps + 1))
    out.append(
        Check(
            "every update logged once",
            state.train_steps == want,
            f"metrics.jsonl update steps {_span(state.train_steps)}",
        )
    )
    ledger = p.get("ledger", [])
    trained = [r for r in ledger if r["state"] == "trained"]
    out.append(_no_group_lost(p))
    counted = p.get("counters", {}).get("groups_trained", -1)
    repeated = len(ledger) - len({r["key"] for r in ledger})
    out.append(
        Check(
            "every group trained exactly once",
            counted == len(trained) and not repeated,
            f"{len(trained)} trained in the ledger, {repeated} records repeated, the "
            f"counter says {counted}",
        )
    )
    eta = cc.acceptance_bound
    worst = max((r["trained_at"] - r["version"] for r in trained), default=0)
    out.append(Check("η_a held", worst <= eta, f"largest staleness trained on {worst}, η_a {eta}"))
    incomplete = [r for r in state.checkpoints if not r.complete]
    bad_snapshots, needed = _snapshots(run_dir, config)
    usable = set(needed)
    out.append(
        Check(
            "checkpoints complete or skipped",
            not [r for r in incomplete if r.step in usable],
            f"{len(state.checkpoints) - len(incomplete)} complete; "
            + (", ".join(f"{r.step}: {r.detail}" for r in incomplete) or "none incomplete"),
        )
    )
    out.append(
        Check(
            "snapshots complete or skipped",
            not bad_snapshots,
            "every snapshot reads" if not bad_snapshots else f"unreadable: {bad_snapshots}",
        )
    )
    out.append(_partial_versions(run_dir, config))
    if reference is not None:
        same = state.final_sha256 and state.final_sha256 == reference.final_sha256
        out.append(
            Check(
                "final weights bitwise equal",
                bool(same),
                f"trainer state sha256 {state.final_sha256[:16] or '-'} vs the "
                f"uninterrupted run's {reference.final_sha256[:16] or '-'}",
            )
        )
        same_ledger = _trained(ledger) == _trained(reference.payload.get("ledger", []))
        out.append(
            Check(
                "same groups trained as the uninterrupted run",
                same_ledger,
                f"{len(trained)} groups, each at the same version",
            )
        )
    return out


def _no_group_lost(p: dict[str, Any]) -> Check:
    """Every prompt the mixture issued is in the ledger (re-issues named by the discard they
    replace): trained, discarded with a reason, or still queued when the run ended."""
    ledger = {r["key"]: r for r in p.get("ledger", [])}
    issued = p.get("mixture", {}).get("issued", 0) - p.get("counters", {}).get(
        "prompts_too_long", 0
    )
    originals = sum("~" not in k for k in ledger)
    dangling = [
        r["key"] for r in ledger.values() if r["replaced_by"] and r["replaced_by"] not in ledger
    ]
    states: dict[str, int] = {}
    for r in ledger.values():
        states[r["state"]] = states.get(r["state"], 0) + 1
    ok = originals == issued and not dangling
    return Check(
        "no group lost",
        ok,
        f"{issued} prompts issued, {originals} in the ledger, "
        f"{len(dangling)} re-issues missing; states {states}",
    )


def _trained(ledger: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    return {r["key"]: (r["version"], r["trained_at"]) for r in ledger if r["state"] == "trained"}


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    dup = len(steps) - len(set(steps))
    return f"{steps[0]}..{steps[-1]} ({len(steps)} records, {dup} repeated)"


def _snapshots(run_dir: Path, config: RunConfig) -> tuple[list[int], list[int]]:
    """(steps of unreadable snapshots not skipped with a warning, versions the readable ones
    need from the trainer's checkpoints), in one pass over the snapshots."""
    store = SnapshotStore(run_dir / "snapshots", keep=config.controller.snapshot_keep)
    bad, versions = [], []
    for step in store.steps():
        try:
            versions.append(int(json.loads(store.load(step)["json"])["version"]))
        except Exception:
            bad.append(step)
    # A torn newest snapshot is skipped with a warning on resume; only the final one must read.
    log = run_dir / "logs" / "controller.log"
    warned = log.read_text() if log.exists() else ""
    return [s for s in bad if f"skipping unreadable snapshot {s}" not in warned], versions


def _partial_versions(run_dir: Path, config: RunConfig) -> Check:
    """No reader logged a version that failed its checksums, and every version each replica
    persisted is whole (torn writes of a killed replica are left uncommitted, never served)."""
    logs = sorted((run_dir / "logs").glob("*.log"))
    seen = [
        f"{f.name}: {line.strip()[:120]}"
        for f in logs
        for line in f.open(errors="replace")
        if any(sign in line for sign in PARTIAL_VERSION_SIGNS)
    ]
    ps = config.param_server
    base = Path(ps.persist_path) if ps.persist_path else run_dir / "param_server"
    dirs = [base / f"replica-{r}" for r in range(ps.replicas)] if ps.replicas > 1 else [base]
    whole = 0
    for d in dirs:
        if not d.exists():
            continue
        store = Persister(None, str(d))  # type: ignore[arg-type]  # reads only: no hot store
        try:
            committed = sorted(store.complete_versions())
            found = store.recover_newest(len(committed))
        finally:
            store.close()
        if len(found) != len(committed):
            seen.append(f"{d.name}: {len(committed) - len(found)} committed versions do not verify")
        whole += len(found)
    detail = (
        f"no reader saw a bad version; {whole} persisted versions verify"
        if not seen
        else "; ".join(seen[:3])
    )
    return Check("parameter server never served a partial version", not seen, detail)
