"""Controller: seconds per update of multi-turn episodes played one by one against lock-step,
with a slow environment.

    .venv/bin/python benchmarks/episode_schedule.py [--steps 4] [--delay 0.5]

Runs the main job twice in one invocation, each in its own child process (same cold start), on
the SmolLM2 code preset with two-attempt code repair (``configs/codeforces.py:smollm2`` with the
overrides of ``benchmarks/real_model.py --task repair``), evaluations off, ``--delay`` seconds
slept before each environment reply (``delayed_environment.py``: an environment calling a
remote service or a slow tool):

* ``lock-step``: ``environment.schedule=lockstep`` with 8 environment threads, the schedule of
  726f913 (every first turn of the step generated, then the replies, then every second turn);
* ``one by one``: ``environment.schedule=episode`` with 64 environment calls at once (each
  episode's reply starts when its turn ends, its second turn is submitted when the reply is
  ready).

Both runs sample the same episodes (the schedule never changes what a turn samples; deterministic
mode plays one by one only where the engine's rows are bitwise). Seconds per update: the mean
interval between consecutive update records of ``metrics.jsonl`` after the first (which
compiles). Per step: weight loads per worker (``pool/loads``) and the tokens later turns took
from kept pages (``episode/prefix_tokens_reused``). The physical limit: the environment's own
time is ``--delay`` per reply, so one-by-one's floor is lock-step's seconds per update less the
time lock-step spends waiting on replies (``time/generate`` minus the engine's generation
seconds, ``pool/generate_s``), reported as "lock-step without the environment".

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
    "lock-step": ("--config.environment.schedule=lockstep", "--config.environment.concurrency=8"),
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
        "--config.data.eval_every=0",
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

    waiting = [
        g - e for g, e in zip(per_step("time/generate"), per_step("pool/generate_s"), strict=True)
    ]
    return {
        "updates": len(steps),
        "s_per_update": statistics.mean(intervals) if intervals else float("nan"),
        "intervals_s": intervals,
        "loads_per_step": per_step("pool/loads"),
        "prefix_tokens_reused": per_step("episode/prefix_tokens_reused"),
        "turns_mean": per_step("episode/turns_mean"),
        "generate_s": per_step("time/generate"),
        "engine_generate_s": per_step("pool/generate_s"),
        "not_generating_s": waiting,
        "reward_mean": per_step("reward/mean"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="updates per run (the first compiles)")
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
            results[schedule] = _analyse(run_dir) | {"wall_s": time.perf_counter() - t0}
            r = results[schedule]
            print(f"  {schedule}: {r['s_per_update']:.1f} s/update, loads {r['loads_per_step']}")
    lock, each = results["lock-step"], results["one by one"]
    floor = lock["s_per_update"] - statistics.mean(lock["not_generating_s"][1:])
    summary = {
        "ratio_one_by_one_over_lock_step": each["s_per_update"] / lock["s_per_update"],
        "lock_step_without_the_environment_s": floor,
        "one_by_one_over_that_floor": each["s_per_update"] / floor,
    }
    print("\n| schedule | s/update | loads per step | prefix tokens reused per step |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['s_per_update']:.1f} | {r['loads_per_step'][1:]} "
            f"| {[int(x) for x in r['prefix_tokens_reused'][1:]]} |"
        )
    print(
        f"\none by one / lock-step: {summary['ratio_one_by_one_over_lock_step']:.3f}; "
        f"lock-step less its waits on replies: {floor:.1f} s/update "
        f"(one by one at {summary['one_by_one_over_that_floor']:.3f}x that floor)"
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
