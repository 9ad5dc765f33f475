"""A preemption drill: the run's topology as processes on 127.0.0.1, with seeded SIGKILLs.

    python -m rlax_tpu.drills --config=configs/codeforces.py:local [--config.a.b=value ...] \
        --kills=N --seed=S [--mode=deterministic|throughput]

Runs the config as `python -m rlax_tpu.launch` does, in <run_dir>/drill, and kills N seeded
components (controller, trainer, an inference worker, a parameter-server replica, the verifier
service; each kind once before any twice; in a multi-process trainer or inference worker, a
target can be one follower process, whose job must then end on its own within 30 s) at seeded
moments, one at a time, restarting each with
the same command after a seeded delay, as Kubernetes restarts a pod. For every kill it prints what
died, when, and the time to recover (restart to the next completed step) in seconds and in median
steps. In deterministic mode it first runs the same config without kills (<run_dir>/reference,
reused when finished) and checks the drilled run against it. Checks: every kill recovered, a killed process
ended its whole job within 30 s, the run finished, every
update logged once, no group lost, every group trained exactly once, η_a held, every checkpoint
and snapshot complete or skipped with a warning, the parameter server never served a partial
version, and (deterministic) final trainer state bitwise equal and the same groups trained at the
same versions. Writes <run_dir>/drill.md and drill.json; exit status 0 when every check passes.
The warm-up (if the config has one) runs once, in <run_dir>/warmup; both runs share one JAX
compilation cache, <run_dir>/jax_cache (or $JAX_COMPILATION_CACHE_DIR).

    python -m rlax_tpu.drills --config=... --check=RUN_DIR [--reference=RUN_DIR]

only runs the checks on a finished run directory (e.g. a GKE run's, copied from GCS).

On GKE the same drill is `kubectl delete pod` on the JobSet's pods (docs/drills.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

from absl import flags

from rlax_tpu import cli
from rlax_tpu.config import RunConfig

KILLS = flags.DEFINE_integer("kills", 5, "How many components to kill (one at a time).")
SEED = flags.DEFINE_integer("seed", 0, "Seed of what is killed, when, and the restart delays.")
CHECK = flags.DEFINE_string("check", None, "Only run the checks on this finished run directory.")
REFERENCE = flags.DEFINE_string(
    "reference", None, "With --check: an uninterrupted run's directory, for the bitwise checks."
)
MODE = flags.DEFINE_enum(
    "mode",
    None,
    ["deterministic", "throughput"],
    "The controller mode to drill (default: the config's).",
)


def run(config: RunConfig, args: list[str]) -> int:
    from absl import logging as absl_logging

    from rlax_tpu import storage
    from rlax_tpu.drills.checks import Check, check_run, read_run
    from rlax_tpu.drills.drill import DrillLaunch, describe, group_end_check, plan, targets_of
    from rlax_tpu.launch.local import Launch

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint it reads
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    kills_n, seed, mode_flag = KILLS.value, SEED.value, MODE.value  # before flags are re-parsed
    if CHECK.value:
        return _check_only(config, Path(CHECK.value), REFERENCE.value)
    if REFERENCE.value:
        raise cli.UsageError("--reference needs --check")
    if kills_n < 1:
        raise cli.UsageError("--kills must be >= 1")
    if storage.is_remote(config.controller.run_dir):
        raise cli.UsageError("a drill runs on this machine: controller.run_dir must be local")
    base = Path(config.controller.run_dir)
    common = cli.config_args(sys.argv[1:])
    if mode_flag:
        common = _override(common, "controller.mode", mode_flag)
    drilled_args = _override(common, "controller.run_dir", str(base / "drill"))
    if mode_flag:
        config = _with(config, mode=mode_flag)
    config = _with(config, run_dir=str(base / "drill"))
    if config.controller.num_steps < 2 * kills_n + 1:
        raise cli.UsageError(
            f"controller.num_steps ({config.controller.num_steps}) must be >= "
            f"2 x --kills + 1 = {2 * kills_n + 1}: kills come one at a time, "
            "a step apart"
        )
    drilled = base / "drill"
    if (drilled / "snapshots").exists():
        raise cli.UsageError(
            f"{drilled} holds a run already; a drill starts from nothing (remove "
            "it or use another controller.run_dir)"
        )
    warmup = str(base / "warmup")
    if config.controller.compilation_cache:
        # One compilation cache for the reference and the drilled run (unless the environment
        # names one): the same programs, so the drilled run starts as warm as its restarts do.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(base / cli.COMPILATION_CACHE_DIR))
    reference = None
    mode = config.controller.mode
    if mode == "deterministic":
        ref_dir = base / "reference"
        ref_args = _override(common, "controller.run_dir", str(ref_dir))
        ref_config = _with(config, run_dir=str(ref_dir))
        print(f"rlax_tpu.drills: the uninterrupted reference run in {ref_dir}", flush=True)
        code = Launch(ref_config, ref_args, warmup_dir=warmup).run()
        if code != 0:
            print(f"rlax_tpu.drills: error: the reference run failed ({code})", file=sys.stderr)
            return 1
        reference = read_run(ref_dir, ref_config)
    kills = plan(targets_of(config), kills_n, seed)
    print(
        f"rlax_tpu.drills: {len(kills)} kills (seed {seed}, {mode} mode) in {drilled}: "
        + ", ".join(k.target for k in kills),
        flush=True,
    )
    launch = DrillLaunch(
        config,
        drilled_args,
        kills,
        out=sys.stdout,
        warmup_dir=warmup,
        recovery_limit_s=config.controller.recovery_timeout_s + 300,
    )
    code = launch.run()
    checks = check_run(drilled, config, reference)
    done = [k for k in kills if k.recovered_at == k.recovered_at]
    checks.insert(
        0,
        Check(
            "every kill recovered",
            len(done) == len(kills) and code == 0,
            f"{len(done)} of {len(kills)} kills recovered; the run exited {code}; "
            f"{len(launch.unplanned)} unplanned exits",
        ),
    )
    checks.insert(1, group_end_check(kills))
    if launch.unplanned:
        checks.append(Check("no unplanned exits", False, "; ".join(launch.unplanned)))
    summary = _summary(launch, kills, mode, config) | {"seed": seed}
    lines = _report(summary, describe(kills), checks)
    print("\n".join(lines), flush=True)
    (base / "drill.md").write_text("\n".join(lines) + "\n")
    (base / "drill.json").write_text(
        json.dumps(summary | {"checks": [c.__dict__ for c in checks]}, indent=2)
    )
    return 0 if all(c.ok for c in checks) else 1


def _check_only(config: RunConfig, run_dir: Path, reference: str | None) -> int:
    from rlax_tpu.drills.checks import check_run, read_run

    if not (run_dir / "snapshots").is_dir():
        raise cli.UsageError(f"{run_dir} holds no run (no snapshots/)")
    ref = read_run(Path(reference), config) if reference else None
    checks = check_run(run_dir, config, ref)
    for c in checks:
        print(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return 0 if all(c.ok for c in checks) else 1


def _with(config: RunConfig, **controller: str) -> RunConfig:
    """``config`` with controller fields replaced (validated again)."""
    return dataclasses.replace(
        config, controller=dataclasses.replace(config.controller, **controller)
    )


def _override(args: list[str], field: str, value: str) -> list[str]:
    """``args`` with ``--config.<field>`` set to ``value`` (absl refuses a flag given twice)."""
    flag = f"--config.{field}"
    return [a for a in args if a.split("=", 1)[0] != flag] + [f"{flag}={value}"]


def _summary(launch, kills, mode: str, config: RunConfig) -> dict:  # noqa: ANN001
    step_s = launch.median_step_s()
    rec = [k.recover_s for k in kills if k.recovered_at == k.recovered_at]
    return {
        "mode": mode,
        "num_steps": config.controller.num_steps,
        "kills": [
            dict(k.__dict__, kind=k.kind, recover_s=k.recover_s, recover_steps=k.recover_s / step_s)
            for k in kills
        ],
        "median_step_s": step_s,
        "recover_mean_s": statistics.fmean(rec) if rec else float("nan"),
        "recover_max_s": max(rec, default=float("nan")),
        "recover_mean_steps": statistics.fmean(rec) / step_s if rec else float("nan"),
        "recover_max_steps": max(rec, default=float("nan")) / step_s,
        "unplanned": launch.unplanned,
    }


def _report(s: dict, kill_lines: list[str], checks: list) -> list[str]:  # noqa: ANN001
    kinds = sorted({k["kind"] for k in s["kills"]})
    return [
        "",
        "=" * 72,
        f"drill: {len(s['kills'])} kills ({', '.join(kinds)}), {s['mode']} mode, seed "
        f"{s['seed']}, {s['num_steps']} steps; median step {s['median_step_s']:.2f} s",
        *kill_lines,
        f"time to recover: mean {s['recover_mean_s']:.1f} s ({s['recover_mean_steps']:.1f} "
        f"steps), max {s['recover_max_s']:.1f} s ({s['recover_max_steps']:.1f} steps)",
        *[f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in checks],
        "=" * 72,
    ]


if __name__ == "__main__":
    cli.main("drills", run)
