"""RL on a real model: SmolLM2-135M-Instruct on two-term sums (configs/smollm2_math.py:cpu) or on
the project's own functions graded in the sandbox (``--task code``: configs/codeforces.py:smollm2),
or those functions as 2-attempt code-repair episodes (``--task repair``: the same preset with
``environment.name=code_repair``; the evaluations report pass@1 after each attempt), or the math
preset with LoRA adapters (``--task lora``) against full fine-tuning run on the same host
(``--task full``: the math preset as it is, into its own directory), or the code preset with
LoRA adapters (``--task code_lora``, run alone on the host as the code task's seeds were, whose
``real_model_code/seed<N>.json`` it is compared with).

    .venv/bin/python benchmarks/real_model.py [--task code] run --seeds 0 1 2 [--minutes 60]
    .venv/bin/python benchmarks/real_model.py trainer      # the trainer step, before and after
    .venv/bin/python benchmarks/real_model.py --task code baseline   # base pass rates by family
    .venv/bin/python benchmarks/real_model.py [--task code] report   # the tables for RESULTS.md

``run`` starts ``python -m rlax_tpu.controller --config=<the task's preset>`` once per
seed (``--config.controller.seed``; held-out evals every 5 versions instead of the preset's 10, for the
curve), stops it at ``--minutes`` of wall time (SIGTERM: the controller's preemption path) and
writes ``benchmarks/real_model/seed<N>.json``: held-out pass@1 / pass@k against version and
minutes since start, reward, |log π_old − log μ|, the step-time breakdown, and raw held-out
answers before and after (from ``<run_dir>/eval/version_<v>.jsonl``). For the code task it then
evaluates HumanEval, which the run never trains on, at version 0 and at the version the run
stopped at (``--evaluate=human_eval``, outside the time budget), into ``seed<N>.json`` too.

``baseline`` (code task) evaluates the initial model on every candidate family with
``--evaluate`` (the functions' training and held-out splits, the bundled stdin/stdout problems,
a seeded sample of the procedural ones): the measurement that chose the training problems.

``trainer`` times one update on synthetic 64-row batches of the preset's shape (SmolLM2's real
shape, random weights: timing does not depend on the values) with the trainer settings before
this issue (nothing-saveable remat, micro-batches of 8, π_old replayed token by token) and the
preset's, against the jitted ``jnp.dot`` peak measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = {  # task -> (preset, output directory)
    "math": ("configs/smollm2_math.py:cpu", Path(__file__).with_suffix("")),
    "code": ("configs/codeforces.py:smollm2", Path(__file__).with_name("real_model_code")),
    "repair": ("configs/codeforces.py:smollm2", Path(__file__).with_name("real_model_repair")),
    # The math preset with LoRA, and without it on the same host and commit: the comparison of
    # issue [lora] (held-out gain in the same wall time).
    "lora": ("configs/smollm2_math.py:cpu", Path(__file__).with_name("real_model_lora") / "lora"),
    "full": ("configs/smollm2_math.py:cpu", Path(__file__).with_name("real_model_lora") / "full"),
    # The code preset with LoRA, run alone on the host as the code task's seeds were (their
    # seed<N>.json are its full fine-tuning side).
    "code_lora": (
        "configs/codeforces.py:smollm2",
        Path(__file__).with_name("real_model_lora") / "code_lora",
    ),
}
# LoRA against full fine-tuning: LoRA task -> the full fine-tuning task it is compared with.
LORA_PAIRS = {"lora": "full", "code_lora": "code"}
# The repair task: the code preset with 2-attempt code_repair episodes. An episode's two turns
# and the verdict's feedback share max_new_tokens (a first turn of at most 192, the feedback
# up to ~200, the rest for the second); micro-batches of 2, as rollouts are about twice the
# code task's (the code task's 4 peaked at 13.5 GB of this host's 24).
TASK_FLAGS = {
    # LoRA for RL: rank matters little and the best learning rate is about 10x full
    # fine-tuning's (Schulman et al., "LoRA Without Regret", Thinking Machines, 2025); the
    # preset's full fine-tuning runs at 1e-5.
    "lora": (
        "--config.model.lora_rank=16",
        "--config.model.lora_alpha=32",
        "--config.trainer.learning_rate=1e-4",
    ),
    # 10x the code preset's 1e-5, as the math task's.
    "code_lora": (
        "--config.model.lora_rank=16",
        "--config.model.lora_alpha=32",
        "--config.trainer.learning_rate=1e-4",
    ),
    "repair": (
        "--config.environment.name=code_repair",
        "--config.environment.max_turns=2",
        "--config.environment.turn_tokens=192",
        "--config.inference.max_new_tokens=512",
        "--config.trainer.micro_batch_size=2",
    ),
}
TASK = "math"
CONFIG, OUT = TASKS[TASK]
EXTERNAL = "human_eval"  # the code task's evaluation on problems it never trains on
# Candidate family -> problems evaluated (0: all). The procedural family has 2,810 instances of
# a few templates: a seeded sample says as much. HumanEval's rate at version 0 is each seed's
# "before" (it is the external evaluation, never a candidate).
BASELINE_FAMILIES = {"functions": 0, "bundled": 0, "procedural": 160}
EVAL_EVERY = 5
SAMPLES_SHOWN = 6
GROUP = 8  # the preset's algorithm.group_size
TRAIN_KEYS = {  # metrics.jsonl scalar -> curve field
    "reward/mean": "reward",
    "rollout/length_mean": "length",
    "trainer/logp_old_behaviour_diff_mean": "dlogp_mean",
    "trainer/logp_old_behaviour_diff_p95": "dlogp_p95",
    "trainer/logp_old_behaviour_diff_max": "dlogp_max",
    "trainer/staleness_max": "staleness",
    "time/generate": "generate_s",
    "time/verify": "verify_s",
    "time/train": "train_s",
    "trainer/time_logp_old_s": "logp_old_s",
    "trainer/time_update_s": "update_s",
    "trainer/time_step_s": "trainer_step_s",
    "trainer/sequence_tokens": "tokens",
}


def _controller(seed: int, run_dir: Path, *flags: str) -> list[str]:
    """The main command of the task's preset for ``seed`` in ``run_dir``."""
    return [
        sys.executable,
        "-m",
        "rlax_tpu.controller",
        f"--config={CONFIG}",
        f"--config.controller.seed={seed}",
        f"--config.controller.run_dir={run_dir}",
        *TASK_FLAGS.get(TASK, ()),
        *flags,
    ]


def _run_seed(seed: int, minutes: float, run_root: Path) -> dict:
    run_dir = run_root / f"seed{seed}"
    cmd = _controller(seed, run_dir, f"--config.data.eval_every={EVAL_EVERY}")
    print("$", " ".join(cmd), flush=True)
    commit = _commit()
    t0 = time.time()
    log = (run_root / f"seed{seed}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = t0 + minutes * 60
    while proc.poll() is None and time.time() < deadline:
        time.sleep(5)
    stopped = proc.poll() is None
    if stopped:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    if not (run_dir / "metrics.jsonl").exists():
        tail = (run_root / f"seed{seed}.log").read_text().splitlines()[-20:]
        raise SystemExit(
            f"seed {seed}: the run wrote no metrics (exit {proc.returncode}):\n" + "\n".join(tail)
        )
    result = _summarize(seed, run_dir, t0, minutes, stopped, proc.returncode) | {
        "commit": commit,
        # The largest process this script has waited for: the controller, whose process holds
        # the trainer and the workers (local transport). Linux reports KiB.
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
    }
    if TASK in ("code", "code_lora"):
        result["external"] = {
            "before": _external_before(seed, run_root),
            "after": _evaluate(run_dir, seed, [EXTERNAL], run_root / f"seed{seed}-eval.log")[
                EXTERNAL
            ],
        }
    return result


def _external_before(seed: int, run_root: Path) -> dict:
    """HumanEval at version 0. A LoRA run starts as its base (B = 0, ``models/layers.py``), the
    code task's initial model, so code_lora takes the code task's seed's when it has one (15
    minutes of evaluation saved a seed)."""
    full = TASKS["code"][1] / f"seed{seed}.json"
    if TASK == "code_lora" and full.exists():
        return json.loads(full.read_text())["external"]["before"] | {
            "from": f"{full.parent.name}/{full.name}"
        }
    before_dir = run_root / f"seed{seed}-v0"
    return _evaluate(before_dir, seed, [EXTERNAL], run_root / f"seed{seed}-v0.log")[EXTERNAL]


def _evaluate(
    run_dir: Path, seed: int, datasets: list[str], log_path: Path, sample: int = 0
) -> dict[str, dict]:
    """``--evaluate`` of the run in ``run_dir`` (its newest version; none: the initial weights),
    on ``sample`` problems of each dataset (0: all): dataset -> its metrics, its answers'
    verdict counts and its first answers."""
    cmd = _controller(
        seed, run_dir, f"--evaluate={','.join(datasets)}", f"--evaluate_sample={sample}"
    )
    print("$", " ".join(cmd), flush=True)
    with log_path.open("w") as log:
        code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log_path.read_text().splitlines()[-20:]
        raise SystemExit(f"--evaluate exited {code}:\n" + "\n".join(tail))
    sys.path.insert(0, str(REPO))
    from rlax_tpu.controller.evaluate import directory_name

    out = {}
    for name in datasets:
        where = run_dir / "eval" / directory_name(name)
        summary = sorted(where.glob("version_*.json"))[-1]
        rows = [json.loads(x) for x in summary.with_suffix(".jsonl").read_text().splitlines()]
        out[name] = json.loads(summary.read_text()) | {
            "verdicts": _verdict_counts(rows),
            "samples": _first_samples(rows),
            "rows": rows,
        }
    return out


def _verdict_counts(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        kind = "no program" if r["detail"] == "no program in the completion" else r["verdict"]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _first_samples(rows: list[dict]) -> list[dict]:
    """The first sample of each of the first SAMPLES_SHOWN problems."""
    seen, shown = set(), []
    for r in rows:
        if r["problem"] not in seen and len(shown) < SAMPLES_SHOWN:
            seen.add(r["problem"])
            shown.append(r)
    return shown


def baseline(root: Path) -> dict:
    """The initial model's pass rates on every candidate family (the code task's choice)."""
    sys.path.insert(0, str(REPO))
    from rlax_tpu.data.functions import load_functions

    found = {}
    for sample in sorted(set(BASELINE_FAMILIES.values())):
        names = [n for n, k in BASELINE_FAMILIES.items() if k == sample]
        found |= _evaluate(
            root / "baseline", 0, names, root / f"baseline-{sample}.log", sample=sample
        )
    split_of = {p.id: s for s, ps in load_functions().items() for p in ps}
    families = {}
    for name, res in found.items():
        rows = res.pop("rows")
        groups = {name: rows}
        if name == "functions":
            groups = {
                f"functions ({split})": [
                    r for r in rows if split_of[r["problem"].split(":", 1)[1]] == split
                ]
                for split in ("train", "held_out")
            }
        for label, rs in groups.items():
            per_problem: dict[str, int] = {}
            for r in rs:
                per_problem[r["problem"]] = per_problem.get(r["problem"], 0) + (
                    r["verdict"] == "accepted"
                )
            families[label] = dict(
                pass1=sum(r["verdict"] == "accepted" for r in rs) / max(len(rs), 1),
                problems=len(per_problem),
                of=int(res["sampled_from"]) if name != "functions" else len(per_problem),
                samples=len(rs),
                problems_ever_passed=sum(c > 0 for c in per_problem.values()),
                verdicts=_verdict_counts(rs),
                per_problem=per_problem,
            )
    return dict(
        families=families,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    )


def _summarize(
    seed: int, run_dir: Path, t0: float, minutes: float, stopped: bool, code: int
) -> dict:
    evals, steps = [], []
    sys.path.insert(0, str(REPO))
    from rlax_tpu.observability.metrics import read_metrics

    for rec in read_metrics(run_dir):
        s, minute = rec["scalars"], (rec["wall_time"] - t0) / 60
        if "eval/pass@1" in s:
            k = next(n for n in s if n.startswith("eval/pass@") and n != "eval/pass@1")
            evals.append(
                dict(
                    version=rec["step"],
                    minutes=minute,
                    pass1=s["eval/pass@1"],
                    passk=s[k],
                    k=int(k.split("@")[1]),
                    eval_s=s["time/eval"],
                )
                | (
                    {"episode_pass1": s["eval/episode_pass@1"]}
                    if "eval/episode_pass@1" in s
                    else {}
                )
            )
        if "reward/mean" in s:
            steps.append(
                {"step": rec["step"], "minutes": minute}
                | {v: s[m] for m, v in TRAIN_KEYS.items() if m in s}
            )
    evals = [e for e in evals if e["minutes"] <= minutes]
    base = evals[0]["pass1"]
    best = max(evals, key=lambda e: e["pass1"])
    first = next((e for e in evals if e["pass1"] - base >= 0.10), None)
    return dict(
        seed=seed,
        command=" ".join(
            (
                CONFIG,
                f"--config.controller.seed={seed}",
                f"--config.data.eval_every={EVAL_EVERY}",
                *TASK_FLAGS.get(TASK, ()),
            )
        ),
        config=CONFIG,
        stopped_at_minutes=minutes if stopped else None,
        exit_code=code,
        evals=evals,
        steps=steps,
        gain=best["pass1"] - base,
        best=best,
        first_plus_10=first,
        answers=_answers(run_dir, evals[0]["version"], evals[-1]["version"]),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    )


def _commit() -> str:
    """HEAD, with "+changes" when the tree differs from it (the seeds must share one commit)."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+changes" if dirty else "")


def _answers(run_dir: Path, before: int, after: int) -> dict:
    """The first sample of the first SAMPLES_SHOWN held-out problems at both versions."""
    out = {}
    for name, v in (("before", before), ("after", after)):
        rows = [
            json.loads(x)
            for x in (run_dir / "eval" / f"version_{v:06d}.jsonl").read_text().splitlines()
        ]
        out[name] = dict(
            version=v,
            samples=_first_samples(rows),
            accepted=sum(r["verdict"] == "accepted" for r in rows),
            total=len(rows),
            verdicts=_verdict_counts(rows),
        )
    return out


def trainer_fraction() -> dict:
    """One 64-row update of the preset's shape, trainer settings before and after; model FLOP/s
    = 6 · params · sequence tokens / step seconds, against the dot peak of this process."""
    sys.path.insert(0, str(Path(__file__).parent))
    import jax
    import numpy as np
    from common import dot_peak
    from trainer_step import Case, timed_steps

    case = Case("smollm2-135m", rows=64, micro=16, prompt=(40, 56), completion=(16, 64), slots=64)
    settings = {
        "before (remat, micro 8, π_old replay)": dict(
            remat=True, micro_batch_size=8, old_logprobs="replay"
        ),
        "after (the preset: no remat, micro 16, π_old prefill)": dict(
            remat=False, micro_batch_size=16, old_logprobs="prefill"
        ),
    }
    peak = dot_peak()
    rows = []
    for name, kw in settings.items():
        n, ms = timed_steps(case, steps=2, group=GROUP, **kw)
        mean = lambda key, ms=ms: float(np.mean([m[key] for m in ms]))  # noqa: E731
        step, tokens, update = mean("time_step_s"), mean("sequence_tokens"), mean("time_update_s")
        rows.append(
            dict(
                name=name,
                step_s=step,
                logp_old_s=mean("time_logp_old_s"),
                update_s=update,
                tokens=tokens,
                fraction_of_peak=6 * n * tokens / step / peak,
                update_fraction_of_peak=6 * n * tokens / update / peak,
            )
        )
        print(rows[-1], flush=True)
    return dict(
        peak_flops_per_s=peak,
        params=int(n),
        rows=rows,
        jax=jax.__version__,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    )


def _crashed(result: dict) -> bool:
    """The run ended on its own with an error, before its wall-time budget stopped it."""
    return result["stopped_at_minutes"] is None and result["exit_code"] != 0


def report(steps: bool = False) -> None:
    seeds = sorted(p for p in OUT.glob("seed*.json") if not p.name.endswith(".crashed.json"))
    print(
        "| seed | pass@1 at v0 | last pass@1 (version, minutes) | best (version) | gain (best) "
        "| first +10 points (version, minutes) | steps in budget |"
    )
    print("|---|---:|---|---|---:|---|---:|")
    for path in seeds:
        r = json.loads(path.read_text())
        b, f = r["best"], r["first_plus_10"]
        first = f"v{f['version']}, {f['minutes']:.0f} min" if f else "not reached"
        last = r["evals"][-1]
        print(
            f"| {r['seed']} | {r['evals'][0]['pass1']:.3f} | {last['pass1']:.3f} "
            f"(v{last['version']}, {last['minutes']:.0f} min) | {b['pass1']:.3f} (v{b['version']}) "
            f"| {r['gain'] * 100:+.1f} | {first} | {len(r['steps'])} |"
        )
    commits = {json.loads(p.read_text()).get("commit", "not recorded") for p in seeds}
    print(f"\ncommit{'s' if len(commits) > 1 else ''}: {', '.join(sorted(commits))}")
    for path in seeds:
        r = json.loads(path.read_text())
        print(f"\nseed {r['seed']}: held-out pass@1 (pass@{r['evals'][0]['k']}) by version")
        print("| version | minutes | pass@1 | pass@k |\n|---:|---:|---:|---:|")
        for e in r["evals"]:
            print(f"| {e['version']} | {e['minutes']:.1f} | {e['pass1']:.3f} | {e['passk']:.3f} |")
        st = r["steps"]
        print("\nreward by step: " + " ".join(f"{x['reward']:.2f}" for x in st))
        mean = {
            k: sum(x.get(k, 0) for x in st[1:]) / max(len(st) - 1, 1)
            for k in (
                "generate_s",
                "logp_old_s",
                "update_s",
                "train_s",
                "dlogp_mean",
                "dlogp_p95",
                "tokens",
            )
        }
        print(
            f"steps 2-{len(st)} mean: generate {mean['generate_s']:.1f} s, π_old "
            f"{mean['logp_old_s']:.1f} s, update {mean['update_s']:.1f} s, train "
            f"{mean['train_s']:.1f} s, {mean['tokens']:.0f} sequence tokens; |Δlogp| mean "
            f"{mean['dlogp_mean']:.2e}, p95 {mean['dlogp_p95']:.2e}, max over steps "
            f"{max(x.get('dlogp_max', 0) for x in st[1:]):.2f}"
        )
        if not steps:
            continue
        print(
            "| step | minutes | reward | length | stale | \\|Δlogp\\| mean / p95 / max | generate s "
            "| π_old s | update s | train s |"
        )
        print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for s in r["steps"]:
            print(
                f"| {s['step']} | {s['minutes']:.1f} | {s['reward']:.3f} | {s['length']:.0f} "
                f"| {s.get('staleness', 0):.0f} | {s.get('dlogp_mean', 0):.2e} / "
                f"{s.get('dlogp_p95', 0):.2e} / {s.get('dlogp_max', 0):.2e} "
                f"| {s.get('generate_s', 0):.1f} | {s.get('logp_old_s', 0):.1f} "
                f"| {s.get('update_s', 0):.1f} | {s.get('train_s', 0):.1f} |"
            )
    if any("external" in json.loads(p.read_text()) for p in seeds):
        _report_code(seeds)
    if any("episode_pass1" in json.loads(p.read_text())["evals"][0] for p in seeds):
        _report_repair(seeds)
    for lora, full in LORA_PAIRS.items():
        if TASK in (lora, full):
            _report_lora(TASKS[full][1], TASKS[lora][1])
    trainer = OUT / "trainer.json"
    if trainer.exists():
        t = json.loads(trainer.read_text())
        print(
            f"\ntrainer step, 64 rollouts; jnp.dot peak {t['peak_flops_per_s'] / 1e9:.0f} GFLOP/s"
        )
        print("| settings | step s | π_old s | update s | tokens | step of peak | update of peak |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in t["rows"]:
            print(
                f"| {r['name']} | {r['step_s']:.1f} | {r['logp_old_s']:.1f} | {r['update_s']:.1f} "
                f"| {r['tokens']:.0f} | {r['fraction_of_peak']:.1%} "
                f"| {r['update_fraction_of_peak']:.1%} |"
            )


def _report_lora(full_dir: Path, lora_dir: Path) -> None:
    """LoRA (``lora_dir``) against full fine-tuning (``full_dir``), seed by seed: held-out
    pass@1 at v0 and at the last evaluation within the same wall-time budget, the steps each
    made and their mean step."""
    pairs = [
        (path, lora_dir / path.name)
        for path in sorted(full_dir.glob("seed*.json"))
        if not path.name.endswith(".crashed.json") and (lora_dir / path.name).exists()
    ]
    if not pairs:
        return
    print(
        "\n| seed | full: v0 -> last (version) | gain | steps | s a step | LoRA: v0 -> last "
        "(version) | gain | steps | s a step | peak RSS GiB full / LoRA | external after, full "
        "/ LoRA |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---|---|")
    gains: dict[str, list[float]] = {"full": [], "lora": []}
    for path, other in pairs:
        row = [path.stem.removeprefix("seed")]
        rss, external = [], []
        for task, p in (("full", path), ("lora", other)):
            r = json.loads(p.read_text())
            e0, e1, st = r["evals"][0], r["evals"][-1], r["steps"]
            gains[task].append(e1["pass1"] - e0["pass1"])
            step_s = (st[-1]["minutes"] - st[0]["minutes"]) * 60 / max(len(st) - 1, 1)
            row += [
                f"{e0['pass1']:.3f} -> {e1['pass1']:.3f} (v{e1['version']})",
                f"{100 * (e1['pass1'] - e0['pass1']):+.1f}",
                str(len(st)),
                f"{step_s:.0f}",
            ]
            rss.append(f"{r['peak_rss_gib']:.1f}" if "peak_rss_gib" in r else "-")
            ext = r.get("external", {}).get("after", {})
            external.append(f"{ext['eval/pass@1']:.3f}" if "eval/pass@1" in ext else "-")
        print("| " + " | ".join(row + [" / ".join(rss), " / ".join(external)]) + " |")
    if gains["full"]:
        print(
            f"\nmean gain at the last evaluation: full {100 * sum(gains['full']) / len(gains['full']):+.1f}"
            f", LoRA {100 * sum(gains['lora']) / len(gains['lora']):+.1f} points "
            f"({len(gains['full'])} seeds)"
        )


def _report_repair(seeds: list[Path]) -> None:
    """Held-out pass@1 after the first attempt and after the second (the episode's last), at
    version 0 and at the last evaluation in the budget."""
    print(
        "\n| seed | first attempt v0 | after repair v0 | first attempt (last) "
        "| after repair (last) | version, minutes |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for path in seeds:
        r = json.loads(path.read_text())
        e0, e1 = r["evals"][0], r["evals"][-1]
        print(
            f"| {r['seed']} | {e0['pass1']:.3f} | {e0['episode_pass1']:.3f} | {e1['pass1']:.3f} "
            f"| {e1['episode_pass1']:.3f} | v{e1['version']}, {e1['minutes']:.0f} min |"
        )


def main() -> None:
    global CONFIG, OUT, TASK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="math")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one run per seed and write seed<N>.json")
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run.add_argument("--minutes", type=float, default=60.0, help="wall-time budget per seed")
    run.add_argument("--run-root", default=None, help="where the run directories go (a temp dir)")
    sub.add_parser("trainer", help="the trainer step before and after, as a fraction of peak")
    base = sub.add_parser("baseline", help="the initial model on every candidate family (code)")
    base.add_argument("--run-root", default=None, help="where the evaluation goes (a temp dir)")
    rep = sub.add_parser("report", help="print the RESULTS.md tables from the JSON files")
    rep.add_argument("--steps", action="store_true", help="also every step of every seed")
    args = parser.parse_args()
    TASK = args.task
    CONFIG, OUT = TASKS[TASK]
    OUT.mkdir(parents=True, exist_ok=True)
    if args.command == "baseline":
        if args.task != "code":
            raise SystemExit("baseline measures the code task's families: use --task code")
        root = Path(args.run_root or tempfile.mkdtemp(prefix="real-model-baseline-"))
        root.mkdir(parents=True, exist_ok=True)
        result = baseline(root)
        (OUT / "baseline.json").write_text(json.dumps(result, indent=2))
        _print_baseline(result)
    if args.command == "run":
        root = Path(args.run_root or tempfile.mkdtemp(prefix="real-model-"))
        root.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            result = _run_seed(seed, args.minutes, root)
            if _crashed(result):  # not a result: kept aside, named, and left out of the report
                (OUT / f"seed{seed}.crashed.json").write_text(json.dumps(result, indent=2))
                print(
                    f"seed {seed} CRASHED (exit code {result['exit_code']}) before its budget: "
                    f"not a result, rerun it (log: {root / f'seed{seed}.log'})",
                    flush=True,
                )
                continue
            (OUT / f"seed{seed}.json").write_text(json.dumps(result, indent=2))
            print(
                f"seed {seed}: pass@1 {result['evals'][0]['pass1']:.3f} -> "
                f"{result['best']['pass1']:.3f} ({result['gain'] * 100:+.1f} points)",
                flush=True,
            )
    if args.command == "trainer":
        (OUT / "trainer.json").write_text(json.dumps(trainer_fraction(), indent=2))
    if args.command == "report":
        report(steps=args.steps)


def _report_code(seeds: list[Path]) -> None:
    """HumanEval before and after, and the programs of the held-out evals before and after."""
    print(
        f"\n{EXTERNAL} (never trained on), pass@1 (unbiased, of data.eval_samples samples at the "
        "preset's temperature) before and after"
    )
    print("| seed | version | pass@1 before | pass@1 after | no program before | after |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in seeds:
        r = json.loads(path.read_text())
        if "external" not in r:
            continue
        b, a = r["external"]["before"], r["external"]["after"]
        print(
            f"| {r['seed']} | {int(a['version'])} | {b['eval/pass@1']:.3f} | {a['eval/pass@1']:.3f} "
            f"| {b['verdicts'].get('no program', 0)} / {sum(b['verdicts'].values())} "
            f"| {a['verdicts'].get('no program', 0)} / {sum(a['verdicts'].values())} |"
        )
    r = json.loads(seeds[0].read_text())
    for when in ("before", "after"):
        ans = r["answers"][when]
        print(
            f"\nseed {r['seed']}, held-out answers at version {ans['version']} ({when}): "
            f"{ans['accepted']} of {ans['total']} accepted; verdicts {ans['verdicts']}"
        )
        for sample in ans["samples"]:
            print(f"\n`{sample['problem']}`: {sample['verdict']}\n")
            print("~~~~\n" + sample["answer"].rstrip() + "\n~~~~")


def _print_baseline(result: dict) -> None:
    print("| family | problems | samples | pass@1 | problems passed at least once | no program |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, f in result["families"].items():
        of = f" of {f['of']}" if f["of"] > f["problems"] else ""
        print(
            f"| {name} | {f['problems']}{of} | {f['samples']} | {f['pass1']:.3f} "
            f"| {f['problems_ever_passed']} | {f['verdicts'].get('no program', 0)} |"
        )


if __name__ == "__main__":
    main()
