"""The planner against reality on this machine: predicted vs measured seconds per update and
staleness, for 1-4 inference workers in both modes.

    .venv/bin/python benchmarks/plan_check.py [--preset local|smollm2] [--workers 1 2 3 4]
        [--steps 16] [--skip 4] [--eval_every K] [--keep DIR [--resume | --analyse]]

Runs the main job (local transport) of a preset once to calibrate (deterministic, on-policy
lock-step, one worker) and then once per mode and worker count. The presets:

* ``local``: ``configs/codeforces.py:local`` with the workload of ``benchmarks/async_speedup.py``
  (8 prompts x 8 samples, up to 96 new tokens, a 150-step warm-up so that programs run and
  rewards vary);
* ``smollm2``: ``configs/smollm2_math.py:cpu`` as it is (SmolLM2-135M-Instruct, 8 prompts x 8
  samples of two-term sums, up to 64 new tokens), its held-out evaluations cut to 8 problems x 1
  sample at the start and the end (outside the measured steps).

The modes:

* ``deterministic``: pipeline depth 1, η_r = 1, η_a = 1 (one-step off-policy);
* ``throughput``: η_r = 1, η_a = 2, oldest first.

The topology is the CPU stand-in of separate accelerators (as in ``async_speedup.py``): the trainer
in a child process on CPU 1, the controller's process (the in-process workers, the verifier and its
sandboxes) on CPU 0, single-threaded XLA ops. So the workers share one core, with the sandboxes:
``--parallel_workers=1`` tells the planner.

``--eval_every K``: the measured runs (not the calibration) evaluate every K updates, beside
training (controller/evaluation.py), on ``EVAL_PROBLEMS`` held-out problems x the group's samples
(the local preset; the smollm2 preset's 8 x 1 as it has them), and the planner predicts that
schedule.

For each run: measured seconds per update (the mean interval between update records after
``--skip``), predicted by ``python -m rlax_tpu.plan --calibrate=<the calibration run>`` for that
config, and the staleness of the groups trained after ``--skip`` from the run's ledger against the
plan's. Writes ``benchmarks/plan_check.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
MODES = {
    "calibration": {"mode": "deterministic", "pipeline_depth": 0, "acceptance_staleness": 0},
    "deterministic": {"mode": "deterministic", "pipeline_depth": 1, "acceptance_staleness": 1},
    "throughput": {"mode": "throughput", "pipeline_depth": 0, "acceptance_staleness": 2},
}


EVAL_PROBLEMS = 8  # held-out problems an evaluation of the local preset takes (--eval_every)


def build_config(  # noqa: ANN201
    preset: str, mode: str, workers: int, steps: int, run_dir: str, eval_every: int = 0
):
    from rlax_tpu.config import RunConfig, from_dict

    if mode == "calibration":
        eval_every = 0  # calibrated on training alone

    common = dict(  # noqa: C408
        run_dir=run_dir,
        num_steps=steps,
        reload_staleness=1,
        seed=0,
        trainer_process=True,
        trainer_cpus=(1,),
        **MODES[mode],
    )
    if preset == "smollm2":
        from configs.smollm2_math import get_config

        cfg = get_config("cpu")
        cfg.controller.update(**common)
        cfg.inference.num_workers = workers
        cfg.data.update(eval_problems=8, eval_samples=1, eval_every=eval_every)
        return from_dict(RunConfig, cfg)
    from configs.codeforces import get_config

    cfg = get_config("local")
    cfg.controller.update(prompts_per_step=8, warmup_steps=150, **common)
    cfg.algorithm.group_size = 8
    cfg.inference.update(max_new_tokens=96, num_workers=workers)
    cfg.trainer.update(micro_batch_size=4, length_bucket=64, precompile=True)
    cfg.verifiers.workers = 1
    if eval_every:
        cfg.data.update(eval_problems=EVAL_PROBLEMS, eval_samples=8, eval_every=eval_every)
    else:
        cfg.data.update(eval_problems=1, eval_samples=1)
    return from_dict(RunConfig, cfg)


def child(args: argparse.Namespace) -> None:
    from rlax_tpu.controller.app import run_job

    config = build_config(
        args.preset, args.child, args.child_workers, args.steps, args.run_dir, args.eval_every
    )
    with open(Path(args.run_dir).parent / f"{Path(args.run_dir).name}.log", "w") as log:
        run_job(config, stream=log)


def measured(run_dir: Path, skip: int) -> dict:
    from rlax_tpu.observability.metrics import read_metrics

    steps = {r["step"]: r for r in read_metrics(run_dir) if "time/train" in r["scalars"]}
    n = max(steps)
    intervals = [steps[k]["wall_time"] - steps[k - 1]["wall_time"] for k in range(skip + 1, n + 1)]
    stale: dict[int, int] = {}
    for path in sorted((run_dir / "ledger").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("state") == "trained" and rec["trained_at"] >= skip:
                s = rec["trained_at"] - rec["version"]
                stale[s] = stale.get(s, 0) + 1
    kept = [steps[k]["scalars"] for k in range(skip + 1, n + 1)]
    return {
        "steps": n,
        "seconds_per_update": statistics.fmean(intervals),
        "staleness": dict(sorted(stale.items())),
        # Where the time went: the trainer's step (its own process, its own core) and the
        # workers' generation (the other core).
        "train_s": statistics.fmean(s["time/train"] for s in kept),
        "generate_s": statistics.fmean(s["time/generate"] for s in kept),
    }


def finished(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir`` holds a run that logged all ``steps`` updates."""
    from rlax_tpu.observability.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return False
    return sum("time/train" in r["scalars"] for r in read_metrics(run_dir)) >= steps


def predicted(
    preset: str, mode: str, workers: int, steps: int, calibration: Path, eval_every: int = 0
) -> dict:
    from rlax_tpu.plan.command import plan

    config = build_config(preset, mode, workers, steps, str(calibration), eval_every)
    _, out = plan(
        config,
        trainer_topology="",
        inference_topology="",
        calibrate=str(calibration),
        workers=[str(workers)],
        parallel_workers=1,
    )
    return out["predictions"][0] | {"assumptions": out["assumptions"]}


def mean_staleness(counts: dict) -> float:
    n = sum(counts.values())
    return sum(int(k) * v for k, v in counts.items()) / n if n else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["local", "smollm2"], default="local")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--modes", nargs="+", default=["deterministic", "throughput"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip", type=int, default=4, help="first updates left out (compiles)")
    parser.add_argument(
        "--eval_every", type=int, default=0, help="measured runs evaluate every K updates"
    )
    parser.add_argument("--out", default="", help="default: benchmarks/plan_check[_PRESET].json")
    parser.add_argument("--keep", default="", help="keep the run directories here")
    parser.add_argument(
        "--analyse", action="store_true", help="only compare again: the runs kept in --keep"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="with --keep: run only what is not there yet (a check split over sessions)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 CPUs: the trainer on one, the workers on the other")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SINGLE_THREAD).strip()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rlax-plan-"))
    root.mkdir(parents=True, exist_ok=True)  # a --keep DIR that does not exist yet
    runs = [("calibration", 1)] + [(m, n) for m in args.modes for n in args.workers]
    rows, out = [], {"preset": args.preset, "runs": []}
    suffix = "" if args.preset == "local" else f"_{args.preset}"
    suffix += f"_eval{args.eval_every}" if args.eval_every else ""
    out_path = args.out or str(HERE / f"plan_check{suffix}.json")
    if (args.analyse or args.resume) and not args.keep:
        raise SystemExit("--analyse and --resume use the runs kept by an earlier --keep DIR")
    for mode, n in runs:
        run_dir = root / f"{mode}-{n}"
        argv = [sys.executable, __file__, "--child", mode, "--child-workers", str(n)]
        argv += ["--preset", args.preset]
        argv += ["--steps", str(args.steps), "--run-dir", str(run_dir)]
        argv += ["--eval_every", str(args.eval_every)]
        t0 = time.perf_counter()
        if not args.analyse and not (args.resume and finished(run_dir, args.steps)):
            # A fresh run: a directory left by a killed one would be resumed, not measured.
            shutil.rmtree(run_dir, ignore_errors=True)
            proc = subprocess.run(
                argv, cwd=REPO, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {0})
            )
            if proc.returncode:
                log = root / f"{mode}-{n}.log"
                print(log.read_text()[-4000:] if log.exists() else "(no log)")
                raise SystemExit(f"{mode} with {n} workers failed: exit code {proc.returncode}")
        got = measured(run_dir, args.skip)
        want = predicted(args.preset, mode, n, args.steps, root / "calibration-1", args.eval_every)
        error = want["seconds_per_update"] / got["seconds_per_update"] - 1
        out["runs"].append(
            {"mode": mode, "workers": n, "wall_s": time.perf_counter() - t0}
            | {"measured": got, "predicted": want, "error": error}
        )
        rows.append(
            f"| {mode} | {n} | {got['seconds_per_update']:.2f} | {want['seconds_per_update']:.2f} "
            f"| {100 * error:+.0f}% | {mean_staleness(got['staleness']):.2f} "
            f"| {mean_staleness(want['staleness']):.2f} | {got['train_s']:.1f} "
            f"| {want['costs']['train_s']:.1f} | {want['bottleneck']} |"
        )
        print(rows[-1], flush=True)
        Path(out_path).write_text(json.dumps(out, indent=2))
    print(
        "| mode | workers | measured s/update | predicted | error | measured staleness (mean) "
        "| predicted | measured train s | predicted | predicted bottleneck |\n|" + "---|" * 10
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
