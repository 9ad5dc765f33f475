"""Training samples: a few rollouts of each update as text, one JSONL object per step
(``<run_dir>/samples/step_<s>.jsonl``, local or gs://; a step done again after a resume
replaces its file), one line a rollout. The controller writes them (controller/samples.py); the
report links a few."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu import storage

SAMPLES_DIR = "samples"
_FILE = re.compile(r"^step_(\d{6,})\.jsonl$")


def samples_path(run_dir: str | Path, step: int) -> storage.epath.Path:
    return storage.path(run_dir) / SAMPLES_DIR / f"step_{step:06d}.jsonl"


def write_samples(run_dir: str | Path, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
    storage.write_atomic(
        samples_path(run_dir, step), "".join(json.dumps(dict(r)) + "\n" for r in rows)
    )


def read_samples(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    path = samples_path(run_dir, step)
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def sampled_steps(run_dir: str | Path) -> list[int]:
    """The steps with samples in ``run_dir``, ascending."""
    directory = storage.path(run_dir) / SAMPLES_DIR
    if not directory.exists():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _FILE.match(p.name)))
