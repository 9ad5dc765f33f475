"""Evaluate a run's newest version on whole datasets it never trains on (``--evaluate``).

    python -m rlax_tpu.controller --config=configs/codeforces.py:smollm2 --evaluate=human_eval

The run's own components are built as for training; the newest snapshot's version is restored (a
run directory without one: the initial weights, before any warm-up) and every problem of each
named dataset (``data.datasets`` names) is sampled ``data.eval_samples`` times with the run's
sampling settings and graded by the verifier. Nothing of the run changes: no step, snapshot,
checkpoint or persisted version is written. Per dataset it writes

    <run_dir>/eval/<dataset>/version_<v>.jsonl   every sample's text and verdict
    <run_dir>/eval/<dataset>/version_<v>.json    pass@1, pass@k, problems, problems too long
"""

from __future__ import annotations

import dataclasses
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
from rlax_tpu.controller.snapshots import SnapshotStore
from rlax_tpu.data.sources import dataset_problems


def _directory_name(dataset: str) -> str:
    """A dataset name as one path component (reasoning_gym:task{...} holds ':' and braces)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset).strip("_") or "dataset"


def evaluate_job(
    config: RunConfig, datasets: Sequence[str], *, stream: TextIO | None = None
) -> dict[str, dict[str, float]]:
    """Dataset name -> its metrics at the run's newest version (see the module docstring)."""
    out = stream or sys.stdout
    cc = config.controller
    run_dir = storage.path(cc.run_dir)
    if SnapshotStore(run_dir / "snapshots", keep=cc.snapshot_keep).latest_step() is None:
        # No run here yet: version 0 is published for the evaluation only and not written
        # through to the persistent store, where a later run would find a version it did not
        # make. (A run's own versions are its to republish, as a resume does.)
        config = dataclasses.replace(
            config, param_server=dataclasses.replace(config.param_server, persist_every=0)
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    problems = {
        name: dataset_problems(name, config.data, seed=cc.seed) for name in datasets
    }  # bad names fail before anything is built
    prompter = build_prompter(config, run_dir)
    if cc.transport == "local":
        comps = components_lib.build_local(
            config,
            model=models.load_model(config.model),
            eos_ids=prompter.tokenizer.stop_ids,
            run_dir=run_dir,
        )
    else:
        comps = components_lib.build_distributed(config)
    results: dict[str, dict[str, float]] = {}
    controller = None
    try:
        controller = Controller(
            config, comps, prompter, run_dir=run_dir, progress_stream=out,
            on_event=lambda t: print(t, file=out, flush=True),
        )  # fmt: skip
        resumed = controller.restore()
        v = controller.version
        print(
            f"rlax_tpu.controller: evaluating version {v} "
            f"({'the newest snapshot' if resumed else 'the initial weights: no snapshot'})",
            file=out,
            flush=True,
        )
        controller.ensure_versions([v])
        for name, ps in problems.items():
            where = run_dir / EVAL_DIR / _directory_name(name)
            keyed = [(f"{name}:{p.id}", p) for p in ps]
            m = controller.evaluate_problems(
                keyed, where / f"version_{v:06d}.jsonl", stream=f"eval/{name}"
            )
            m = m | {"version": float(v), "eval/too_long": float(len(ps) - m["eval/problems"])}
            storage.write_atomic(where / f"version_{v:06d}.json", json.dumps(m, indent=1))
            k = config.data.eval_samples
            more = f", pass@{k} {m[f'eval/pass@{k}']:.3f}" if k > 1 else ""
            print(
                f"{name} at version {v}: pass@1 {m['eval/pass@1']:.3f}{more} on "
                f"{int(m['eval/problems'])} problems ({int(m['eval/too_long'])} too long), "
                f"{m['time/eval']:.0f} s; answers in {where}",
                file=out,
                flush=True,
            )
            results[name] = m
    finally:
        if controller is not None:
            controller.close()
        comps.close()
    return results
