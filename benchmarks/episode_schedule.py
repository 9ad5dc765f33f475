"""Controller: seconds per update of multi-turn episodes played one by one against lock-step,
with a slow environment.

    .venv/bin/python benchmarks/episode_schedule.py [--steps 3] [--delay 0.5]

Runs the main job twice in one invocation, each in its own child process (same cold start), on
the SmolLM2 code preset with two-attempt code repair (``configs/codeforces.py:smollm2`` with the
overrides of ``benchmarks/real_model.py --task repair``) and ``--delay`` seconds slept before each
environment reply (``delayed_environment.py``: an environment calling a remote service or a slow
tool). Both with 64 environment calls at once, so the schedule is the only difference:

* ``lock-step``: ``environment.schedule=lockstep``: every first turn of the step generated,
  then the replies, then every second turn;
* ``one by one``: ``environment.schedule=episode``: each episode's reply starts when its turn
  ends and its second turn is submitted when the reply is ready.

``pipeline_depth=0``, so a step's episodes are on the critical path (with the preset's 1 they
overlap the previous update, which on this CPU takes longer than they do), and evaluations of one
problem and one sample (they cannot be turned off: version 0 and the last are evaluated). Both
runs sample the same episodes; deterministic mode plays one by one only where the engine's rows
are bitwise, and the script fails if the one-by-one run fell back to lock-step.

Reported per run: seconds per update (the mean interval between consecutive update records of
``metrics.jsonl`` after the first, which compiles), the episode phase per step
(``time/generate``: launch to the last episode's end), weight loads per step over the workers
(``pool/loads``; one worker here) and the tokens later turns took from kept pages
(``episode/prefix_tokens_reused``). The physical limit of the episode phase: the engine's own
seconds generating the step's turns, measured in the same run (``pool/generate_s`` of the
lock-step run, whose generation calls never overlap one another): no schedule makes the episode
phase shorter than the generation it holds.

Prints a markdown table and writes ``episode_schedule.json`` next to this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from real_model import TASK_FLAGS  # noqa: E402 - the repair task's overrides, as in its runs

SCHEDULES = {
    "lock-step": ("--config.environment.schedule=lockstep", "--config.environment.concurrency=64"),
    "one by one": ("--config.environment.schedule=episode", "--config.environment.concurrency=64"),
}


def _command(run_dir: Path, steps: int, schedule: str, seed: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlax_tpu.controller",
        "--config=configs/codeforces.py:smollm2",
        *TASK_FLAGS["repair"],
        "--config.algorithm.plugins=delayed_environment",
        "--config.environment.name=delayed_code_repair",
        f"--config.controller.num_steps={steps}",
        f"--config.controller.seed={seed}",
        "--config.controller.pipeline_depth=0",
        "--config.data.eval_every=0",
        "--config.data.eval_problems=1",
        "--config.data.eval_samples=1",
        f"--config.controller.run_dir={run_dir}",
        *SCHEDULES[schedule],
    ]


def _analyse(run_dir: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from rlax_tpu.observability.metrics import read_metrics

    steps = [r for r in read_metrics(run_dir) if "reward/mean" in r["scalars"]]
    intervals = [b["wall_time"] - a["wall_time"] for a, b in zip(steps, steps[1:], strict=False)]

    def per_step(key: str) -> list[float]:
        return [float(r["scalars"].get(key) or 0.0) for r in steps]

    return {
        "updates": len(steps),
        "s_per_update": statistics.mean(intervals) if intervals else float("nan"),
        "intervals_s": intervals,
        "loads_per_step": per_step("pool/loads"),
        "prefix_tokens_reused": per_step("episode/prefix_tokens_reused"),
        "turns_mean": per_step("episode/turns_mean"),
        "generate_s": per_step("time/generate"),
        "train_s": per_step("time/train"),
        "engine_generate_s": per_step("pool/generate_s"),
        "reward_mean": per_step("reward/mean"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="updates per run (the first compiles)")
    p.add_argument("--delay", type=float, default=0.5, help="seconds before each reply")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2: the first update is not timed")
    env = dict(os.environ)
    env["RLAX_ENV_DELAY_S"] = str(args.delay)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    results = {}
    with tempfile.TemporaryDirectory(prefix="episode_schedule_") as tmp:
        for schedule in SCHEDULES:
            run_dir = Path(tmp) / schedule.replace(" ", "_")
            cmd = _command(run_dir, args.steps, schedule, args.seed)
            print("$", " ".join(cmd), flush=True)
            t0 = time.perf_counter()
            log = run_dir.with_suffix(".log")
            with log.open("w") as out:
                code = subprocess.call(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
            if code:
                sys.exit(f"{schedule} failed ({code}); its log:\n{log.read_text()[-4000:]}")
            if schedule == "one by one" and "take their turns in lock-step" in log.read_text():
                sys.exit("the one-by-one run fell back to lock-step (rows not bitwise here)")
            results[schedule] = _analyse(run_dir) | {"wall_s": time.perf_counter() - t0}
            r = results[schedule]
            print(f"  {schedule}: {r['s_per_update']:.1f} s/update", flush=True)
    lock, each = results["lock-step"], results["one by one"]

    def steady(values: list[float]) -> float:
        return statistics.mean(values[1:]) if len(values) > 1 else float("nan")

    summary = {
        "s_per_update_ratio": each["s_per_update"] / lock["s_per_update"],
        "episode_phase_s": {k: steady(r["generate_s"]) for k, r in results.items()},
        "engine_generate_s": steady(lock["engine_generate_s"]),
    }
    summary["episode_phase_ratio"] = (
        summary["episode_phase_s"]["one by one"] / summary["episode_phase_s"]["lock-step"]
    )
    summary["one_by_one_over_engine_s"] = (
        summary["episode_phase_s"]["one by one"] / summary["engine_generate_s"]
    )
    print(
        "\n| schedule | s/update | episode phase s | loads per step | kept-page tokens per step |"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['s_per_update']:.1f} | {steady(r['generate_s']):.1f} "
            f"| {r['loads_per_step'][1:]} | {[int(x) for x in r['prefix_tokens_reused'][1:]]} |"
        )
    print(
        f"\none by one / lock-step: s/update {summary['s_per_update_ratio']:.3f}, episode phase "
        f"{summary['episode_phase_ratio']:.3f}; the engine's own generation "
        f"{summary['engine_generate_s']:.1f} s a step (one by one's phase at "
        f"{summary['one_by_one_over_engine_s']:.2f}x it)"
    )
    out = {
        "command": " ".join(["benchmarks/episode_schedule.py", *sys.argv[1:]]),
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "delay_s": args.delay,
        "steps": args.steps,
        "results": results,
        "summary": summary,
    }
    (HERE / "episode_schedule.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
