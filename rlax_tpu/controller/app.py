"""The main job, end to end: data, tokenizer, (warm-up), components, the step loop, the report.

``python -m rlax_tpu.controller`` calls :func:`run_job`; tests call it in process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from rlax_tpu import environments, models, storage
from rlax_tpu.config import RunConfig, to_dict
from rlax_tpu.controller import components as components_lib
from rlax_tpu.controller.groups import Prompter
from rlax_tpu.controller.loop import Controller, RunSummary
from rlax_tpu.controller.pool import NoWorkers
from rlax_tpu.controller.snapshots import SnapshotStore
from rlax_tpu.controller.state import refuse_incompatible
from rlax_tpu.controller.tasks import FENCE, prompt_text
from rlax_tpu.data.mixture import stream_seed
from rlax_tpu.data.problems import (
    CodeProblem,
    MathProblem,
    Problem,
    Solution,
    UnitTestProblem,
)
from rlax_tpu.data.sources import Datasets, load_datasets
from rlax_tpu.observability.progress import format_duration
from rlax_tpu.observability.report import RunInfo, write_report
from rlax_tpu.rpc.transport import ComponentFailed

TOKENIZER_DIR = "tokenizer"
WARMUP_NOTE = "warmup.json"
# A local LoRA run's warmed-up base: its trainer checkpoints hold the adapters alone.
WARMUP_BASE = "warmup_base"


def reference_text(problem: Problem, *, language: str) -> str | None:
    """The completion a perfect raw-style model writes (warm-up data), or None."""
    if isinstance(problem, CodeProblem):
        return _first_program(problem.reference_solutions, language)
    if isinstance(problem, UnitTestProblem):
        return problem.canonical_solution or None
    if isinstance(problem, MathProblem):
        return f" {problem.answer}"
    return None


def wrong_text(problem: Problem, *, language: str) -> str | None:
    """A known-wrong raw-style completion (a problem's first wrong program), or None."""
    if isinstance(problem, CodeProblem):
        return _first_program(problem.wrong_solutions, language)
    return None


def _first_program(solutions: Sequence[Solution], language: str) -> str | None:
    """The first program in ``language``, closed by the fence as a raw-style completion is."""
    code = next((s.code for s in solutions if s.language == language), None)
    return None if code is None else code + FENCE


def warmup_demonstration(problem: Problem, config: RunConfig) -> tuple[str | None, bool]:
    """The warm-up completion for ``problem`` and whether it is a wrong one: a wrong program with
    probability ``controller.warmup_wrong_fraction`` (seeded per problem id), else the reference."""
    language = config.data.language
    fraction = config.controller.warmup_wrong_fraction
    if fraction > 0:
        u = stream_seed(config.controller.seed, "warmup-wrong", problem.id) / 2.0**64
        wrong = wrong_text(problem, language=language) if u < fraction else None
        if wrong is not None:
            return wrong, True
    return reference_text(problem, language=language), False


def prepare_tokenizer(
    config: RunConfig, datasets: Datasets, run_dir: storage.epath.Path
) -> models.Tokenizer:
    """The model's tokenizer; a randomly initialized model without one gets a BPE trained on the
    task's text (saved in the run directory, so a resumed run uses the same one)."""
    if config.model.tokenizer_path or config.model.weights_format != "init":
        return models.load_tokenizer(config.model)
    saved = run_dir / TOKENIZER_DIR
    if (saved / "tokenizer.json").exists():
        return models.Tokenizer.from_file(saved)
    from rlax_tpu.controller.warmup import build_tokenizer

    texts = []
    for problems in datasets.train.values():
        for p in problems:
            texts.append(prompt_text(p, style="raw", language=config.data.language))
            ref = reference_text(p, language=config.data.language)
            if ref:
                texts.append(ref)
    tokenizer = build_tokenizer(texts, config.model.vocab_size)
    tokenizer.save(saved)
    return tokenizer


def warm_up(
    config: RunConfig, model: models.Transformer, prompter: Prompter, log: TextIO
) -> tuple[models.Transformer, str]:
    """Supervised warm-up on the training problems' reference solutions; (model, report note)."""
    from rlax_tpu.controller.warmup import supervised_warmup

    cc = config.controller
    examples = []
    num_wrong = 0
    eos = prompter.tokenizer.eos_id
    for problems in prompter.datasets.train.values():
        for p in problems:
            text, wrong = warmup_demonstration(p, config)
            if text is None or not prompter.fits(p):
                continue
            completion = prompter.tokenizer.encode(text, add_bos=False)
            if eos is not None:
                completion = [*completion, eos]
            if len(completion) <= config.inference.max_new_tokens:
                examples.append((list(prompter.prompt_tokens(p)), completion))
                num_wrong += wrong
    if not examples:
        raise ValueError(
            "controller.warmup_steps > 0 but no training problem has a reference "
            f"solution in {config.data.language}"
        )
    t0 = time.perf_counter()
    every = max(1, cc.warmup_steps // 5)

    def on_step(step: int, loss: float) -> None:
        if step % every == 0 or step == cc.warmup_steps:
            print(f"warm-up step {step}/{cc.warmup_steps}: loss {loss:.3f}", file=log, flush=True)

    model = supervised_warmup(
        model,
        examples,
        steps=cc.warmup_steps,
        batch_size=cc.warmup_batch_size,
        learning_rate=cc.warmup_learning_rate,
        seed=cc.seed,
        on_step=on_step,
    )
    note = (
        f"a supervised warm-up of {cc.warmup_steps} steps (batch {cc.warmup_batch_size}, lr "
        f"{cc.warmup_learning_rate:g}) on {len(examples)} demonstrations "
        f"({num_wrong} of them known-wrong programs) ran before RL "
        f"({time.perf_counter() - t0:.0f} s); pass@1 at version 0 is after warm-up, "
        "before RL"
    )
    return model, note


def build_prompter(config: RunConfig, run_dir: storage.epath.Path) -> Prompter:
    """The run's datasets, tokenizer and prompt format, as the controller uses them."""
    datasets = load_datasets(config.data, seed=config.controller.seed)
    tokenizer = prepare_tokenizer(config, datasets, run_dir)
    return Prompter(
        datasets,
        tokenizer,
        style=config.prompt_style,
        language=config.data.language,
        group_size=config.algorithm.group_size,
        seed=config.controller.seed,
        max_prompt_len=config.inference.max_prompt_len,
        stop_token_ids=sorted(tokenizer.stop_ids),  # remote workers may not have the tokenizer
        instructions=environments.instructions(config.environment.name),
    )


def export_warmup(config: RunConfig, out_dir: str, *, stream: TextIO | None = None) -> None:
    """Runs only the supervised warm-up (``controller.warmup_steps``) and writes the warmed-up
    model to ``out_dir`` as an HF checkpoint (config.json + safetensors) with its tokenizer.

    Services started apart (``python -m rlax_tpu.launch``, the distributed transport) load
    weights instead of training them: they start from ``model.weights_format=safetensors,
    model.weights_path=out_dir``. The report's note goes to ``<run_dir>/warmup.json`` as in a
    local run. ``out_dir`` may be gs:// (written through a local copy).
    """
    out = stream or sys.stdout
    if config.controller.warmup_steps == 0:
        raise ValueError("controller.warmup_steps is 0: there is no warm-up to export")
    run_dir = storage.path(config.controller.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prompter = build_prompter(config, run_dir)
    model, note = warm_up(config, models.load_model(config.model), prompter, out)
    write_weights(model, prompter, out_dir)
    storage.write_atomic(run_dir / WARMUP_NOTE, json.dumps({"note": note}))
    print(f"rlax_tpu.controller: warm-up weights written to {out_dir}", file=out, flush=True)


def write_weights(model: models.Transformer, prompter: Prompter, out_dir: str) -> None:
    """``model`` as an HF checkpoint (config.json + safetensors, LoRA adapters merged in
    float32) with the run's tokenizer in ``out_dir`` (local or gs://); config.json is written
    last, so its presence says the checkpoint is complete."""
    import tempfile

    from rlax_tpu.models.checkpoint import save_safetensors

    with tempfile.TemporaryDirectory(prefix="rlax-warmup-") as scratch:
        files = [*save_safetensors(model, scratch), Path(scratch) / "config.json"]
        prompter.tokenizer.save(scratch)
        files += [Path(scratch) / "tokenizer.json", Path(scratch) / "tokenizer_config.json"]
        target = storage.path(out_dir)
        target.mkdir(parents=True, exist_ok=True)
        for file in sorted(files, key=lambda f: f.name == "config.json"):
            storage.write_atomic(target / file.name, file.read_bytes())


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_job(config: RunConfig, *, stream: TextIO | None = None, command: str = "") -> RunSummary:
    """Runs (or resumes) the job of ``config``; writes ``<run_dir>/report.md``."""
    out = stream or sys.stdout
    cc = config.controller
    run_dir = storage.path(cc.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"rlax_tpu.controller: run directory {run_dir} ({cc.mode} mode, {cc.transport} transport)",
        file=out,
        flush=True,
    )
    snapshots = SnapshotStore(run_dir / "snapshots", keep=cc.snapshot_keep)
    fresh = snapshots.latest_step() is None
    if not fresh:
        refuse_incompatible(config, snapshots, run_dir)
    prompter = build_prompter(config, run_dir)
    tokenizer = prompter.tokenizer
    notes: list[str] = []
    if cc.transport == "local" and fresh and cc.warmup_steps:
        model, note = warm_up(config, models.load_model(config.model), prompter, out)
        notes.append(note)
        storage.write_atomic(run_dir / WARMUP_NOTE, json.dumps({"note": note}))
    elif (run_dir / WARMUP_NOTE).exists():  # also a warm-up exported for launched services
        notes.append(json.loads((run_dir / WARMUP_NOTE).read_text())["note"])
    if cc.transport == "local":
        if config.model.lora_rank and cc.warmup_steps:
            # The trainer's checkpoints hold the adapters alone: the warmed-up base is kept in
            # the run directory, and every start, fresh or resumed, loads it from there.
            base_dir = str(run_dir / WARMUP_BASE)
            if fresh:
                write_weights(model, prompter, base_dir)
            model = models.load_model(
                dataclasses.replace(
                    config.model, weights_format="safetensors", weights_path=base_dir
                )
            )
        elif not (fresh and cc.warmup_steps):
            model = models.load_model(config.model)
        comps = components_lib.build_local(
            config,
            model=model,
            eos_ids=tokenizer.stop_ids,
            run_dir=run_dir,
            detokenize=tokenizer.text_of,
        )
    else:
        comps = components_lib.build_distributed(config)
    print(
        "components: " + ", ".join(f"{k} {v}" for k, v in comps.endpoints.items()),
        file=out,
        flush=True,
    )
    holder = [comps]
    try:
        summary = _run_recovering(config, holder, prompter, run_dir, out)
        if holder[0].params_digest is not None:
            summary.weights_sha256 = holder[0].params_digest()
    finally:
        if holder[0].handoff is not None:
            n = holder[0].handoff.counts
            print(
                f"weight loads: {n['device_loads']} device to device, {n['server_loads']} from "
                "the parameter server",
                file=out,
                flush=True,
            )
        holder[0].close()
    if summary.already_finished:
        print(
            f"rlax_tpu.controller: {run_dir} already finished {summary.steps_done} steps; "
            "nothing to do (raise controller.num_steps to train further)",
            file=out,
        )
        if (run_dir / "report.md").exists():
            return summary
        # The process that finished was stopped after its last snapshot, before its report.
        notes.append(
            "the report was written by a later invocation on the finished run (the "
            "one that finished it stopped first); wall time is not the run's"
        )
    info = RunInfo(
        command=command or "python -m rlax_tpu.controller",
        config=to_dict(config),
        model=_describe(config),
        commit=_commit(),
        notes=notes,
    )
    report = write_report(run_dir, info, summary=_summary_dict(summary))
    print_summary(summary, report, out)
    return summary


def _run_recovering(
    config: RunConfig,
    comps: list[components_lib.Components],
    prompter: Prompter,
    run_dir: Path,
    out: TextIO,
) -> RunSummary:
    """Runs the controller. With the distributed transport a component that stops answering is
    waited for (``controller.recovery_timeout_s``, counted from the last failure after which no
    step was completed) and the run resumes from its newest snapshot with fresh channels, as a
    restarted controller would. ``comps`` holds the current components (replaced on recovery)."""
    cc = config.controller
    streak_start, best_step = 0.0, -1
    while True:
        controller = Controller(
            config,
            comps[0],
            prompter,
            run_dir=run_dir,
            progress_stream=out,
            on_event=lambda t: print(t, file=out, flush=True),
        )
        try:
            return controller.run()
        except (ComponentFailed, NoWorkers) as e:
            if cc.transport != "distributed" or cc.recovery_timeout_s <= 0:
                raise
            controller.drain()
            now = time.monotonic()
            if controller.step > best_step:  # progress since the last failure: a new streak
                streak_start, best_step = now, controller.step
            left = cc.recovery_timeout_s - (now - streak_start)
            if left <= 0:
                raise
            print(
                f"rlax_tpu.controller: {e}; waiting up to {left:.0f} s for it to serve again",
                file=out,
                flush=True,
            )
            comps[0].close()
            components_lib.wait_until_serving(config, left)
            comps[0] = components_lib.build_distributed(config)
            print(
                "rlax_tpu.controller: every component serves again; resuming from the newest "
                "snapshot",
                file=out,
                flush=True,
            )


def _describe(config: RunConfig) -> str:
    m = config.model
    src = "random init" if m.weights_format == "init" else f"{m.weights_format} {m.weights_path}"
    return f"{m.arch}, {m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size} ({src})"


def _summary_dict(s: RunSummary) -> dict[str, Any]:
    return dataclasses.asdict(s) | {"evals": {str(k): v for k, v in s.evals.items()}}


def print_summary(s: RunSummary, report: Path, out: TextIO) -> None:
    c = s.counters
    lines = [
        "",
        "=" * 72,
        f"run finished: {s.steps_done} updates (version {s.version}) in "
        f"{format_duration(s.wall_s)}",
        f"prompt groups: {c['groups_trained']} trained, {c['groups_filtered']} filtered, "
        f"{c['groups_discarded_stale']} discarded as stale, "
        f"{c['groups_verifier_failed']} dropped on verifier errors",
        f"tokens generated: {c['tokens_generated']}",
    ]
    if s.publish_to_serve_s:
        t = sorted(s.publish_to_serve_s)
        p95 = t[max(0, math.ceil(0.95 * len(t)) - 1)]
        lines.append(
            f"publish to serve (trainer's publish -> every worker serving the version): median "
            f"{statistics.median(t):.2f} s, p95 {p95:.2f} s over {len(t)} versions"
        )
    if s.weight_loads:
        lines.append(
            f"weights over the network: {s.wire_bytes / 2**20:.1f} MiB in {s.weight_loads} "
            f"loads ({s.wire_bytes / s.weight_loads / 2**20:.2f} MiB a load)"
        )
    if c.get("groups_refilled") or c.get("updates_skipped"):
        lines.insert(
            4,
            f"dynamic sampling: {c['groups_refilled']} groups drawn to refill "
            f"batches, {c['groups_surplus']} surplus, {c['updates_skipped']} updates "
            "skipped with nothing to learn",
        )
    if s.evals:
        first, last = min(s.evals), max(s.evals)
        p0, p1 = s.evals[first].get("eval/pass@1"), s.evals[last].get("eval/pass@1")
        if p0 is not None and p1 is not None:
            lines.append(
                f"held-out pass@1: {p0:.3f} at version {first} -> {p1:.3f} at version "
                f"{last} ({100 * (p1 - p0):+.1f} points)"
            )
    if s.weights_sha256:
        lines.append(f"final weights sha256: {s.weights_sha256}")
    lines += [f"report: {report}", f"run directory: {s.run_dir}", "=" * 72]
    print("\n".join(lines), file=out, flush=True)
