"""The run report: ``<run_dir>/report.md`` with PNG plots, built from the run's metrics
(:func:`~rlax_tpu.observability.metrics.read_metrics`).

Metric names the report understands (the controller logs them):
  reward/mean                      training reward per step
  eval/pass@<k>                    held-out pass@k (logged on evaluation steps)
  throughput/tokens_per_s          generated tokens per second
  staleness (histogram)            staleness of the rollouts consumed by the step
  verdict/<name>                   verifier verdict counts per step
  time/<phase>                     seconds per step in generate, verify, train, publish, wait
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rlax_tpu import storage
from rlax_tpu.observability.metrics import read_metrics
from rlax_tpu.observability.samples import SAMPLES_DIR, read_samples, sampled_steps

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _plt() -> Any:
    """matplotlib.pyplot, imported when a plot is drawn (half a second off every start-up)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    return plt


REWARD = "reward/mean"
EVAL_PREFIX = "eval/pass@"
TOKENS_PER_S = "throughput/tokens_per_s"
STALENESS = "staleness"
VERDICT_PREFIX = "verdict/"
TIME_PREFIX = "time/"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What was run, so a reader can reproduce it."""

    command: str
    config: Mapping[str, Any]
    model: str
    commit: str
    notes: Sequence[str] = ()  # e.g. "a supervised warm-up of 200 steps ran before RL"


def _series(records: Sequence[dict], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [
        (r["step"], r["wall_time"], r["scalars"][name])
        for r in records
        if r["scalars"].get(name) is not None
    ]
    if not rows:
        return np.array([]), np.array([]), np.array([])
    steps, times, values = map(np.asarray, zip(*rows, strict=True))
    return steps, times, values


def _save(fig: Figure, path: storage.epath.Path) -> None:
    """Writes the figure as PNG (local or gs://) and closes it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _plt().close(fig)
    storage.write_atomic(path, buf.getvalue())


def _names(records: Sequence[dict], prefix: str) -> list[str]:
    return sorted({k for r in records for k in r["scalars"] if k.startswith(prefix)})


def _plot_learning(records: Sequence[dict], t0: float, path: storage.epath.Path) -> bool:
    evals = _names(records, EVAL_PREFIX)
    if not _series(records, REWARD)[0].size and not evals:
        return False
    fig, axes = _plt().subplots(1, 2, figsize=(11, 4))
    for name in [REWARD, *evals]:
        steps, times, values = _series(records, name)
        if steps.size:
            style = "-" if name == REWARD else "o-"
            axes[0].plot(steps, values, style, label=name)
            axes[1].plot((times - t0) / 60, values, style, label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall time (min)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("training reward and held-out pass@k")
    fig.tight_layout()
    _save(fig, path)
    return True


def _plot_staleness(records: Sequence[dict], path: storage.epath.Path) -> bool:
    values = [v for r in records for v in r["histograms"].get(STALENESS, [])]
    if not values:
        return False
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    top = int(max(values))
    ax.hist(values, bins=np.arange(-0.5, top + 1.5, 1.0), rwidth=0.85)
    ax.set_xlabel("staleness of consumed rollouts (versions)")
    ax.set_ylabel("rollouts")
    fig.tight_layout()
    _save(fig, path)
    return True


def _plot_line(records: Sequence[dict], name: str, ylabel: str, path: storage.epath.Path) -> bool:
    steps, _, values = _series(records, name)
    if not steps.size:
        return False
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    ax.plot(steps, values)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    return True


def _totals(records: Sequence[dict], prefix: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for r in records:
        for k, v in r["scalars"].items():
            if k.startswith(prefix) and v is not None:
                totals[k.removeprefix(prefix)] += v
    return dict(totals)


def _plot_bars(totals: Mapping[str, float], xlabel: str, path: storage.epath.Path) -> bool:
    if not totals:
        return False
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    names = sorted(totals, key=lambda k: -totals[k])
    ax.barh(names, [totals[n] for n in names])
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    _save(fig, path)
    return True


def _plot_step_time(records: Sequence[dict], path: storage.epath.Path) -> bool:
    phases = _names(records, TIME_PREFIX)
    if not phases:
        return False
    steps = [r["step"] for r in records]
    stacks = [[r["scalars"].get(p) or 0.0 for r in records] for p in phases]
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    ax.stackplot(steps, stacks, labels=[p.removeprefix(TIME_PREFIX) for p in phases])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    _save(fig, path)
    return True


def _first_last(records: Sequence[dict], name: str) -> tuple[float, float] | None:
    _, _, values = _series(records, name)
    return (float(values[0]), float(values[-1])) if values.size else None


def _spread(items: Sequence[int], n: int) -> list[int]:
    """Up to ``n`` of ``items``, first and last included, evenly apart."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _samples_section(run_dir: storage.epath.Path, shown: int = 4) -> list[str]:
    """Links to a few steps' training samples (observability/samples.py), one example each."""
    steps = sampled_steps(run_dir)
    if not steps:
        return []
    lines = [
        "## Training samples",
        "",
        f"{len(steps)} updates have samples in `samples/`; a few:",
        "",
    ]
    for step in _spread(steps, shown):
        rows = read_samples(run_dir, step)
        link = f"[step {step}]({SAMPLES_DIR}/step_{step:06d}.jsonl)"
        if not rows:
            lines.append(f"- {link}: none")
            continue
        r = rows[0]
        advantage = "n/a" if r.get("advantage") is None else f"{r['advantage']:+.3f}"
        excerpt = " ".join(str(r["completion"]).split())[:100].replace("`", "'")
        lines.append(
            f"- {link}: {len(rows)} rollouts; the first: reward {r['reward']:.2f}, advantage "
            f"{advantage}, staleness {r['staleness']}, {r['finish_reason']} after "
            f"{r['tokens']} tokens: `{excerpt}`"
        )
    return [*lines, ""]


def write_report(
    run_dir: str | Path, info: RunInfo, summary: Mapping[str, Any] | None = None
) -> storage.epath.Path:
    """Writes ``report.md`` and its plots into ``run_dir`` (local or gs://); returns the report's
    path."""
    run_dir = storage.path(run_dir)
    records = sorted(read_metrics(run_dir), key=lambda r: r["step"])
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    t0 = records[0]["wall_time"] if records else 0.0
    plots = {
        "Reward and held-out pass@k": ("learning.png", lambda p: _plot_learning(records, t0, p)),
        "Staleness histogram": ("staleness.png", lambda p: _plot_staleness(records, p)),
        "Generated tokens/s": (
            "tokens_per_s.png",
            lambda p: _plot_line(records, TOKENS_PER_S, "tokens/s", p),
        ),
        "Verifier verdicts": (
            "verdicts.png",
            lambda p: _plot_bars(_totals(records, VERDICT_PREFIX), "rollouts", p),
        ),
        "Step-time breakdown": ("step_time.png", lambda p: _plot_step_time(records, p)),
    }
    lines = ["# Run report", "", f"Run directory: `{run_dir}`", ""]
    lines += [
        "## What was run",
        "",
        f"- command: `{info.command}`",
        f"- model: {info.model}",
        f"- commit: `{info.commit}`",
        f"- steps logged: {len(records)}",
    ]
    lines += [f"- note: {n}" for n in info.notes]
    lines += [""]
    results = []
    for name in [REWARD, *_names(records, EVAL_PREFIX)]:
        fl = _first_last(records, name)
        if fl:
            results.append(f"| {name} | {fl[0]:.3f} | {fl[1]:.3f} | {fl[1] - fl[0]:+.3f} |")
    if results:
        lines += [
            "## Results",
            "",
            "| metric | first | last | change |",
            "|---|---|---|---|",
            *results,
            "",
        ]
    if summary:
        lines += ["## Summary", "", "```", json.dumps(summary, indent=2, default=str), "```", ""]
    lines += _samples_section(run_dir)
    lines += ["## Plots", ""]
    for title, (filename, plot) in plots.items():
        if plot(plots_dir / filename):
            lines += [f"### {title}", "", f"![{title}](plots/{filename})", ""]
        else:
            lines += [f"### {title}", "", "_not logged in this run_", ""]
    lines += ["## Config", "", "```json", json.dumps(info.config, indent=2, default=str), "```", ""]
    report = run_dir / "report.md"
    storage.write_atomic(report, "\n".join(lines))
    return report
