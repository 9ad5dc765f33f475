"""Controller: wall-clock speedup of one-step off-policy over on-policy lock-step.

    .venv/bin/python benchmarks/async_speedup.py [--steps 24] [--quick]

Runs the main job (``rlax_tpu.controller.app.run_job``, local transport, the ``codeforces.py:local``
preset) twice in one invocation, on the same workload and for the same number of updates:

* ``lock-step``: deterministic mode, pipeline_depth 0, η_r 1, η_a 0. Generation of step s waits
  for version s, so generation (+ verification) and training never overlap.
* ``off-policy``: deterministic mode, pipeline_depth 1, η_r 1, η_a 1. Generation of step s + 1
  with version s runs while step s trains.

Each mode runs in its own child process (same cold start: fresh XLA compilation, fresh run
directory, fresh verifier) with identical config apart from those three fields and identical
environment: both inherit this process's, and with ``--xla-threads 1`` (the default) both get
single-threaded XLA:CPU ops appended to ``XLA_FLAGS`` (on 2 shared cores that made the lock-step
baseline faster too, see RESULTS.md). Per-step times come from
``<run_dir>/metrics.jsonl``: the steady-state seconds per step is the mean interval between
consecutive update records over steps ``--skip + 1 .. N`` (the first ``--skip`` updates compile);
the median interval is reported beside it (steps with long rollouts, checkpoint saves and, with
``--precompile 0``, compiles for new length buckets make a few intervals long, and off-policy hides
some of them behind generation).
The lock-step run also gives the overlap bound of this workload on this machine:
(gen + verify + train) / max(gen + verify, train) per step, which a perfect one-step overlap
would reach (at most 2x, when the two phases are balanced). Reward curves of both runs are
printed, so a speedup is not bought with learning.

Topology (both modes alike): with ``--trainer-process 1`` (the default) the trainer runs in a child
process (``controller.trainer_process``), so generation and training do not share one Python
interpreter (GIL) and XLA client: the CPU stand-in for the separate devices the two phases have
in RLAX and Asynchronous RLHF. ``--trainer-process 0`` keeps everything in one process. With
``--pin 1`` (the default on 2+ CPUs) the controller's process (engine, verifier, sandboxes) runs
on CPU 0 and the trainer child on CPU 1 (``controller.trainer_cpus``), and the verifier has one
slot: each phase gets one core of its own, as each would get its own accelerator.

Workload (defaults): 8 prompts x G = 8 rollouts per step, up to 96 new tokens, micro-batches of 4
rows, 1 verifier slot, after a 150-step supervised warm-up on reference solutions (the same in
both runs, before the controller's clock starts) so that the tiny model writes programs that run
and sometimes pass (a random model's output is rejected at once: verification is nearly free
and every reward is 0). The knobs were chosen so that generate + verify ~ train per lock-step step.
The held-out eval (version 0 and N, one problem, one sample) is in the total wall time but not in
the per-step times. With ``--precompile 1`` (the default) both runs set ``trainer.precompile``:
the update is compiled for every micro-batch shape during step 1, so the steady steps time the
overlap, not XLA compiles (the table's "compiles" column counts those that still happened).

Prints a markdown table and writes JSON next to this script (``async_speedup.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# XLA:CPU runs each op on one thread (no intra-op Eigen pool); see RESULTS.md for why.
SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

MODES = {
    "lock-step": {"pipeline_depth": 0, "reload_staleness": 1, "acceptance_staleness": 0},
    "off-policy": {"pipeline_depth": 1, "reload_staleness": 1, "acceptance_staleness": 1},
}


def build_config(args: argparse.Namespace, mode: str, run_dir: str):
    sys.path.insert(0, str(REPO))
    from configs.codeforces import get_config
    from rlax_tpu.config import RunConfig, from_dict

    cfg = get_config("local")
    cfg.controller.update(
        run_dir=run_dir,
        num_steps=args.steps,
        prompts_per_step=args.prompts,
        mode="deterministic",
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        **MODES[mode],
    )
    cfg.algorithm.group_size = args.group_size
    cfg.inference.max_new_tokens = args.max_new_tokens
    cfg.trainer.micro_batch_size = args.micro_batch
    cfg.trainer.length_bucket = args.length_bucket
    cfg.verifiers.sandbox_uid = args.sandbox_uid
    cfg.verifiers.workers = args.verifier_workers
    cfg.controller.trainer_process = bool(args.trainer_process)
    cfg.trainer.precompile = bool(args.precompile)
    if args.pin:
        cfg.controller.trainer_cpus = (1,)
    # Held-out eval runs at version 0 and N in both modes; keep it tiny (it is not timed below).
    cfg.data.eval_problems = 1
    cfg.data.eval_samples = 1
    return from_dict(RunConfig, cfg)


def child(args: argparse.Namespace) -> None:
    from rlax_tpu.controller.app import run_job

    config = build_config(args, args.child, args.run_dir)
    with open(Path(args.run_dir).parent / f"{args.child}.log", "w") as log:
        summary = run_job(config, stream=log)
    (Path(args.run_dir) / "summary.json").write_text(
        json.dumps(
            {"wall_s": summary.wall_s, "steps": summary.steps_done, "counters": summary.counters}
        )
    )


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def analyse(run_dir: Path, skip: int, child_wall_s: float) -> dict:
    sys.path.insert(0, str(REPO))
    from rlax_tpu.observability.metrics import read_metrics

    records = read_metrics(run_dir)
    steps = {r["step"]: r for r in records if "reward/mean" in r["scalars"]}
    n = max(steps)
    assert sorted(steps) == list(range(1, n + 1)), sorted(steps)
    steady = list(range(skip + 1, n + 1))
    intervals = [steps[k]["wall_time"] - steps[k - 1]["wall_time"] for k in steady]

    def mean(name: str) -> float:
        return statistics.fmean(steps[k]["scalars"].get(name) or 0.0 for k in steady)

    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "steps": n,
        "total_wall_s": summary["wall_s"],
        "process_wall_s": child_wall_s,
        "steady_steps": f"{skip + 1}..{n}",
        "s_per_step": statistics.fmean(intervals),
        "s_per_step_median": statistics.median(intervals),
        "step_intervals_s": intervals,
        "generate_s": mean("time/generate"),
        "verify_s": mean("time/verify"),
        "train_s": mean("time/train"),
        "wait_s": mean("time/wait"),
        "train_logp_old_s": mean("trainer/time_logp_old_s"),
        "train_update_s": mean("trainer/time_update_s"),
        # Update compilations during the steady steps (the trainer's per-process count).
        "steady_compilations": steps[n]["scalars"].get("trainer/update_compilations", 0.0)
        - steps[skip]["scalars"].get("trainer/update_compilations", 0.0),
        "completion_len": mean("rollout/length_mean"),
        "tokens_per_s": mean("throughput/tokens_per_s"),
        "reward_curve": [steps[k]["scalars"]["reward/mean"] for k in range(1, n + 1)],
        "pass_rate_curve": [steps[k]["scalars"].get("reward/pass_rate") for k in range(1, n + 1)],
        "staleness_max": max(max(steps[k]["histograms"].get("staleness") or [0]) for k in steps),
        "counters": summary["counters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="updates per mode")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 steps, a small batch")
    parser.add_argument("--skip", type=int, default=4, help="first updates left out (compiles)")
    parser.add_argument("--prompts", type=int, default=8, help="controller.prompts_per_step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--length-bucket", type=int, default=64)
    parser.add_argument("--verifier-workers", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trainer-process",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: controller.trainer_process (the trainer in a child process)",
    )
    parser.add_argument(
        "--precompile",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: trainer.precompile (every micro-batch shape compiled in step 1)",
    )
    parser.add_argument("--sandbox-uid", type=int, default=2_800_000)
    parser.add_argument("--modes", default="lock-step,off-policy")
    parser.add_argument(
        "--pin",
        type=int,
        choices=(0, 1),
        default=int((os.cpu_count() or 1) >= 2),
        help="1: the controller process (engine, verifier, sandboxes) on CPU 0 and "
        "the trainer child on CPU 1 (needs --trainer-process 1 and 2+ CPUs)",
    )
    parser.add_argument(
        "--xla-threads",
        choices=("default", "1"),
        default="1",
        help="1: single-threaded XLA:CPU ops in both runs (appended to XLA_FLAGS of both children)",
    )
    parser.add_argument("--out", default=str(HERE / "async_speedup.json"))
    parser.add_argument("--keep", help="copy the run directories and logs here")
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.steps, args.prompts, args.group_size, args.max_new_tokens = 4, 4, 4, 48
        args.micro_batch, args.skip, args.warmup_steps = 8, 2, 0
        if args.out == str(HERE / "async_speedup.json"):
            args.out = os.devnull
    if args.pin and (not args.trainer_process or (os.cpu_count() or 1) < 2):
        parser.error("--pin 1 needs --trainer-process 1 and at least 2 CPUs")
    if args.steps <= args.skip:
        parser.error(f"--steps must be > --skip ({args.skip})")

    workload = {
        k: getattr(args, k)
        for k in (
            "steps",
            "prompts",
            "group_size",
            "max_new_tokens",
            "micro_batch",
            "length_bucket",
            "verifier_workers",
            "warmup_steps",
            "trainer_process",
            "pin",
            "precompile",
            "seed",
            "skip",
        )
    }
    env = dict(os.environ)
    if args.xla_threads == "1":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SINGLE_THREAD).strip()
    env_note = {k: env[k] for k in ("XLA_FLAGS", "OMP_NUM_THREADS") if k in env}
    print(f"workload: {workload}; env: {env_note or 'defaults'}; cpus: {os.cpu_count()}")
    load = {"start": load_avg()}
    print(f"load average at start: {load['start']}", flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlax-async-") as tmp:
        for mode in args.modes.split(","):
            run_dir = Path(tmp) / mode
            argv = [sys.executable, __file__, "--child", mode, "--run-dir", str(run_dir)]
            argv += [
                f"--{k.replace('_', '-')}={v}" for k, v in workload.items() if k not in ("skip",)
            ]
            t0 = time.perf_counter()
            pin = (lambda: os.sched_setaffinity(0, {0})) if args.pin else None
            proc = subprocess.run(argv, cwd=REPO, env=env, preexec_fn=pin)
            wall = time.perf_counter() - t0
            if proc.returncode:
                log = Path(tmp) / f"{mode}.log"
                print(log.read_text()[-4000:] if log.exists() else "(no log)")
                raise SystemExit(f"{mode} run failed with exit code {proc.returncode}")
            results[mode] = analyse(run_dir, args.skip, wall)
            load[f"after {mode}"] = load_avg()
            r = results[mode]
            print(
                f"{mode}: {r['steps']} steps, {r['total_wall_s']:.1f} s, steady "
                f"{r['s_per_step']:.2f} s/step; load average {load[f'after {mode}']}",
                flush=True,
            )
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    report(results, workload, load, env_note, args.out)


def report(results: dict, workload: dict, load: dict, env_note: dict, out: str) -> None:
    lock, off = results.get("lock-step"), results.get("off-policy")
    rows = []
    header = (
        "| mode | steps | total wall s | mean s/step (steady) | median s/step | generate s/step "
        "| verify s/step | train s/step | wait s/step | compiles (steady) | final reward "
        "| reward curve |"
    )
    rows += [header, "|" + "---|" * 12]
    for mode, r in results.items():
        curve = ", ".join(f"{x:.3f}" for x in r["reward_curve"])
        rows.append(
            f"| {mode} | {r['steps']} | {r['total_wall_s']:.1f} | {r['s_per_step']:.2f} "
            f"| {r['s_per_step_median']:.2f} | {r['generate_s']:.2f} | {r['verify_s']:.2f} | {r['train_s']:.2f} "
            f"| {r['wait_s']:.2f} | {r['steady_compilations']:.0f} "
            f"| {r['reward_curve'][-1]:.3f} | [{curve}] |"
        )
    summary: dict = {}
    if lock:
        rollout = lock["generate_s"] + lock["verify_s"]
        train = lock["train_s"]
        bound = (rollout + train) / max(rollout, train)
        summary |= {
            "lockstep_rollout_s": rollout,
            "lockstep_train_s": train,
            "gen_train_ratio": rollout / train,
            "overlap_bound": bound,
        }
    if lock and off:
        speedup = lock["s_per_step"] / off["s_per_step"]
        summary |= {
            "speedup_steady": speedup,
            "speedup_median": lock["s_per_step_median"] / off["s_per_step_median"],
            "speedup_total": lock["total_wall_s"] / off["total_wall_s"],
            "fraction_of_bound": (speedup - 1) / (summary["overlap_bound"] - 1)
            if summary["overlap_bound"] > 1
            else float("nan"),
        }
    print()
    print("\n".join(rows))
    print()
    if lock:
        print("| measure | value |\n|---|---|")
        print(f"| lock-step generate + verify s/step | {summary['lockstep_rollout_s']:.2f} |")
        print(f"| lock-step train s/step | {summary['lockstep_train_s']:.2f} |")
        print(f"| (generate + verify) / train | {summary['gen_train_ratio']:.2f} |")
        print(f"| overlap bound (g + t) / max(g, t) here | {summary['overlap_bound']:.2f}x |")
        print("| overlap bound, balanced phases | 2.00x |")
    if lock and off:
        print(
            f"| **speedup, steady s/step** (target >= 1.5x) | **{summary['speedup_steady']:.2f}x** |"
        )
        print(f"| speedup, median step interval | {summary['speedup_median']:.2f}x |")
        print(f"| speedup, total wall (incl. compile, eval) | {summary['speedup_total']:.2f}x |")
        print(
            f"| fraction of the bound's gain: (speedup - 1) / (bound - 1) "
            f"| {100 * summary['fraction_of_bound']:.0f}% |"
        )
    print(f"\nload average (1, 5, 15 min): {' -> '.join(f'{k}: {v}' for k, v in load.items())}")
    payload = {
        "workload": workload,
        "env": env_note,
        "load_average": load,
        "summary": summary,
        "results": results,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    if out != os.devnull:
        Path(out).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
