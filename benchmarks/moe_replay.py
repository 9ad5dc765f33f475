"""A tiny mixture-of-experts model trained by RL on CPU, with routing replay off and on.

    .venv/bin/python benchmarks/moe_replay.py [--seeds 0 1] [--replay off both] [--steps 60]
    .venv/bin/python benchmarks/moe_replay.py --report   # the table of the runs kept so far

Each run is ``make run``'s job (``codeforces.py:local``: supervised warm-up, then GRPO on
procedural + bundled problems graded in the sandbox, held-out evaluations) with the tiny model
made a Qwen3-MoE (8 experts, top 2, expert width 96 in place of the dense MLP) and two changes
that put it where a TPU run is:

* ``model.compute_dtype = bfloat16`` (the presets'): the engine's decode and the trainer's
  forward round differently, so a token whose router probabilities nearly tie can go to other
  experts in the two;
* ``trainer.old_logprobs = prefill`` (the TPU default): π_old is one prefill-shaped pass on the
  trainer, not the CPU's token-by-token replay of the engine's own programs (which reproduces
  the engine's routes by construction and would hide the effect).

``trainer.routing_replay`` is the only difference between the runs of one seed ("off": both
trainer forwards route by their own router; "both": π_old and π_θ use the worker's experts).
Per update the report takes from ``<run>/metrics.jsonl``: |log π_old - log μ| (mean and max
over the update's completion tokens: the trainer/sampler mismatch), the importance ratio's
max, the reward; and held-out pass@1 before and after. One child process per run, one at a
time; runs and their logs are kept under ``--root`` and the JSON is written next to this script
(``moe_replay.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MOE = (
    "--config.model.arch=qwen3_moe",
    "--config.model.num_experts=8",
    "--config.model.experts_per_token=2",
    "--config.model.expert_intermediate_size=96",
    "--config.model.compute_dtype=bfloat16",
    "--config.trainer.old_logprobs=prefill",
)


def run(root: Path, seed: int, replay: str, steps: int) -> Path:
    run_dir = root / f"seed{seed}-{replay}"
    if (run_dir / "report.md").exists():
        print(f"{run_dir.name}: kept from an earlier invocation", flush=True)
        return run_dir
    cmd = [
        sys.executable,
        "-m",
        "rlax_tpu.controller",
        "--config=configs/codeforces.py:local",
        f"--config.controller.run_dir={run_dir}",
        f"--config.controller.seed={seed}",
        f"--config.controller.num_steps={steps}",
        f"--config.trainer.routing_replay={replay}",
        *MOE,
    ]
    t0 = time.perf_counter()
    with open(root / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
    print(f"{run_dir.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def analyse(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if "trainer/logp_old_behaviour_diff_mean" in r["scalars"]]
    evals = [
        (r["step"], r["scalars"]["eval/pass@1"]) for r in records if "eval/pass@1" in r["scalars"]
    ]
    series = lambda key: [r["scalars"][key] for r in updates]  # noqa: E731
    diff_mean = series("trainer/logp_old_behaviour_diff_mean")
    return {
        "updates": len(updates),
        "diff_mean": statistics.fmean(diff_mean),
        "diff_mean_curve": diff_mean,
        "diff_max": max(series("trainer/logp_old_behaviour_diff_max")),
        "diff_max_curve": series("trainer/logp_old_behaviour_diff_max"),
        "ratio_max": max(series("trainer/ratio_max")),
        "reward_curve": series("reward/mean"),
        "pass1": evals,
    }


def report(root: Path) -> dict:
    runs = {}
    for run_dir in sorted(p for p in root.iterdir() if (p / "report.md").exists()):
        runs[run_dir.name] = analyse(run_dir)
    print(
        "| run | updates | mean |Δ log p| | max |Δ log p| | max ratio | reward, first 10 -> "
        "last 10 updates | held-out pass@1 (first -> last eval) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        rw = r["reward_curve"]
        first, last = r["pass1"][0], r["pass1"][-1]
        print(
            f"| {name} | {r['updates']} | {r['diff_mean']:.2e} | {r['diff_max']:.3f} | "
            f"{r['ratio_max']:.3f} | {statistics.fmean(rw[:10]):.3f} -> "
            f"{statistics.fmean(rw[-10:]):.3f} | {first[1]:.3f} (v{first[0]}) -> "
            f"{last[1]:.3f} (v{last[0]}) |"
        )
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--replay", nargs="+", default=["off", "both"], choices=["off", "old", "both"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--root", type=Path, default=Path("/tmp/moe_replay"))
    ap.add_argument("--report", action="store_true", help="only the table of the kept runs")
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for seed in args.seeds:
            for replay in args.replay:
                run(args.root, seed, replay, args.steps)
    runs = report(args.root)
    out = {"command": " ".join(sys.argv), "moe_flags": MOE, "runs": runs}
    (HERE / "moe_replay.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
