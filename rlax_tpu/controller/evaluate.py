"""Evaluate a run's version on whole datasets it never trains on (``--evaluate``).

    python -m rlax_tpu.controller --config=configs/codeforces.py:smollm2 --evaluate=human_eval

The run's components are built in this process (local transport) as for training, at the version
a resume would restore (the newest snapshot with a complete trainer checkpoint; a run directory
without one: the initial weights, before any warm-up), and every problem of each named dataset
(``data.datasets`` names) is sampled ``data.eval_samples`` times with the run's sampling settings
and graded by the verifier. The run is left as it was: no step, snapshot, log, checkpoint or
metric is written (a corrupt checkpoint is still removed, as a resume would). With
``--evaluate_sample=N``, N problems of each dataset, chosen by controller.seed. Per dataset:

    <run_dir>/eval/<dataset>/version_<v>.jsonl   every sample's text and verdict
    <run_dir>/eval/<dataset>/version_<v>.json    pass@1, pass@k, problems, problems too long,
                                                 the dataset's size (sampled_from)

With an environment (``environment.name``) every sample is also played out as an episode: pass@1
and pass@k stay the first attempts', ``eval/episode_pass@1`` and ``@k`` count the episodes whose
last turn was accepted, and each answer's line holds its episode.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Sequence
from typing import TextIO

from rlax_tpu import models, storage
from rlax_tpu.config import RunConfig
from rlax_tpu.controller import components as components_lib
from rlax_tpu.controller.app import build_prompter
from rlax_tpu.controller.loop import EVAL_DIR, Controller
from rlax_tpu.data.problems import DataError
from rlax_tpu.data.sources import dataset_problems, seeded_choice

PROGRESS_CHUNK = 32  # problems sent at a time, with a progress line after each


def directory_name(dataset: str) -> str:
    """A dataset name as one path component: itself if it is one already, else its safe
    characters and a hash of the whole (reasoning_gym:task{...} holds ':' and braces, and two
    option sets must not share a directory)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset).strip("_.") or "dataset"
    if safe == dataset:
        return safe
    return f"{safe[:60]}-{hashlib.sha256(dataset.encode()).hexdigest()[:8]}"


def evaluate_job(
    config: RunConfig,
    datasets: Sequence[str],
    *,
    sample: int = 0,
    stream: TextIO | None = None,
) -> dict[str, dict[str, float]]:
    """Dataset name -> its metrics at the run's version (see the module docstring); with
    ``sample`` > 0, on a choice of that many problems per dataset seeded by controller.seed.

    Raises DataError for an unknown dataset or one with no problem that fits, before any
    component is built; ValueError for a distributed run."""
    out = stream or sys.stdout
    cc = config.controller
    if cc.transport != "local":
        # Its trainer serves a run that may be training: restoring a version there would
        # rewind it under that run.
        raise ValueError(
            "--evaluate builds the run's components in this process: it needs "
            "controller.transport = 'local' (evaluate a distributed run's checkpoints with a "
            "local config of the same model and run_dir)"
        )
    if sample < 0:
        raise ValueError(f"the sample of problems per dataset must be >= 0, got {sample}")
    whole = {name: dataset_problems(name, config.data, seed=cc.seed) for name in datasets}
    problems = {
        name: seeded_choice(ps, sample, seed=cc.seed, stream=f"evaluate/{name}") if sample else ps
        for name, ps in whole.items()
    }
    run_dir = storage.path(cc.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prompter = build_prompter(config, run_dir)
    for name, ps in problems.items():
        fitting = sum(prompter.fits(p) for p in ps)
        if not fitting:
            raise DataError(
                name,
                None,
                f"none of its {len(ps)} prompts fits in inference.max_prompt_len = "
                f"{config.inference.max_prompt_len} tokens",
            )
        trained = " (the run trains on it: not an external evaluation)"
        of = f" (a seeded sample of {len(whole[name])})" if len(ps) < len(whole[name]) else ""
        print(
            f"{name}: {len(ps)} problems{of}, {len(ps) - fitting} longer than inference."
            f"max_prompt_len{trained if name in config.data.datasets else ''}",
            file=out,
            flush=True,
        )
    comps = components_lib.build_local(
        config,
        model=models.load_model(config.model),
        eos_ids=prompter.tokenizer.stop_ids,
        run_dir=run_dir,
        detokenize=prompter.tokenizer.text_of,
    )
    results: dict[str, dict[str, float]] = {}
    controller = None
    try:
        controller = Controller(
            config, comps, prompter, run_dir=run_dir, progress_stream=out,
            on_event=lambda t: print(t, file=out, flush=True),
        )  # fmt: skip
        version = controller.newest_restorable_version()
        if version is not None:
            comps.trainer.restore(version)
            controller.version = version
        what = "the initial weights: no snapshot" if version is None else "its newest snapshot"
        print(
            f"rlax_tpu.controller: evaluating version {controller.version} ({what})",
            file=out,
            flush=True,
        )
        v = controller.version
        controller.ensure_versions([v])
        for name, ps in problems.items():
            where = run_dir / EVAL_DIR / directory_name(name)
            m = controller.evaluate_problems(
                [(f"{name}:{p.id}", p) for p in ps],
                where / f"version_{v:06d}.jsonl",
                stream=f"eval/{name}",
                chunk=PROGRESS_CHUNK,
            )
            m |= {
                "version": float(v),
                "eval/too_long": float(len(ps) - m["eval/problems"]),
                "trained_on": float(name in config.data.datasets),
                "sampled_from": float(len(whole[name])),
            }
            storage.write_atomic(where / f"version_{v:06d}.json", json.dumps(m, indent=1))
            k = config.data.eval_samples
            more = f", pass@{k} {m[f'eval/pass@{k}']:.3f}" if k > 1 else ""
            if "eval/episode_pass@1" in m:  # environment.name: each answer played out
                more += f", after the episode {m['eval/episode_pass@1']:.3f}"
            print(
                f"{name} at version {v}: pass@1 {m['eval/pass@1']:.3f}{more} on "
                f"{int(m['eval/problems'])} problems, {m['time/eval']:.0f} s; answers in {where}",
                file=out,
                flush=True,
            )
            results[name] = m
    finally:
        if controller is not None:
            controller.close()
        comps.close()
    return results
