"""The Weights & Biases sink (observability.sinks: "wandb").

One W&B run per run directory: its id is kept in ``<run_dir>/wandb_run.json``, so a resumed run
(after a preemption, on another host) continues the same W&B run. Training records are logged
at their step: the steps a resumed run does again are ones W&B has already, and it keeps the
first (W&B takes a step once; metrics.jsonl keeps the resumed run's). Evaluations finish beside
training, after later steps were logged: they are logged at the newest step with their version
as ``eval/version``, the x axis W&B plots ``eval/*`` against.
"""

from __future__ import annotations

import json
import os
import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tpu import storage
from rlax_tpu.config import to_dict
from rlax_tpu.observability.sinks import SinkContext, bins

RUN_FILE = "wandb_run.json"  # {"id": the W&B run id}
EVAL_PREFIX = "eval/"
EVAL_AXIS = "eval/version"


def run_id(run_dir: storage.epath.Path) -> str:
    """The W&B run id of ``run_dir``: the one it holds, else a new random one, kept there.
    Random, not drawn from the config's seed: W&B ids name runs across a whole project, and
    two runs of one config (seeds apart or not) are two runs."""
    path = run_dir / RUN_FILE
    if path.exists():
        return str(json.loads(path.read_text())["id"])
    alphabet = string.ascii_lowercase + string.digits
    new = "".join(secrets.choice(alphabet) for _ in range(12))
    storage.write_atomic(path, json.dumps({"id": new}))
    return new


def local_dir(context: SinkContext) -> str:
    """The directory W&B is given (it writes into its ``wandb/``): observability.wandb.dir,
    else the (local) run directory."""
    configured = context.config.observability.wandb.dir
    if configured:
        return configured
    if storage.is_remote(context.run_dir):
        raise ValueError(
            "observability.wandb.dir: a gs:// run directory needs a local directory for W&B's "
            "files (W&B writes through the local file system)"
        )
    return os.fspath(context.run_dir)


class WandbSink:
    def __init__(self, context: SinkContext):
        import wandb  # the client costs its import (about 1 s) only in runs that use it

        self._wandb = wandb
        cfg = context.config.observability.wandb
        directory = local_dir(context)
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity or None,
            name=cfg.name or context.run_dir.name,
            group=cfg.group or None,
            tags=list(cfg.tags) or None,
            id=run_id(context.run_dir),
            resume="allow",
            dir=directory,
            config=to_dict(context.config),
            # WANDB_MODE in the environment wins, as W&B's own documentation has it.
            mode=os.environ.get("WANDB_MODE") or cfg.mode,
            # console off: W&B would otherwise wrap the controller's stdout and stderr (its
            # progress lines and the logs a launcher collects). Stats off: no process of W&B's
            # sampling the host beside the run (its CPU and memory; not the TPUs).
            settings=wandb.Settings(
                console="off", save_code=False, disable_git=True, x_disable_stats=True
            ),
        )
        self._run.define_metric(EVAL_AXIS)
        self._run.define_metric(f"{EVAL_PREFIX}*", step_metric=EVAL_AXIS)
        self._newest = -1  # the newest step logged

    def _at(self, step: int) -> int:
        self._newest = max(self._newest, step)
        return self._newest

    def log(
        self,
        step: int,
        wall_time: float,
        scalars: Mapping[str, float],
        histograms: Mapping[str, Sequence[float]],
    ) -> None:
        del wall_time  # W&B stamps its own
        row: dict[str, Any] = {k: float(v) for k, v in scalars.items() if _finite(v)}
        row |= {
            k: self._wandb.Histogram(np_histogram=bins(v)) for k, v in histograms.items() if len(v)
        }
        if any(k.startswith(EVAL_PREFIX) for k in row):  # an evaluation's (its timing too)
            row[EVAL_AXIS] = step
        self._run.log(row, step=self._at(step))

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))  # every row's, in order
        data = [[_cell(r.get(c)) for c in columns] for r in rows]
        row: dict[str, Any] = {name: self._wandb.Table(columns=columns, data=data)}
        if name.startswith(EVAL_PREFIX):
            row[EVAL_AXIS] = step
        self._run.log(row, step=self._at(step))

    def close(self) -> None:
        self._run.finish()


def _finite(v: float) -> bool:
    v = float(v)
    return v == v and abs(v) != float("inf")


def _cell(v: Any) -> Any:
    """A table cell W&B takes: numbers and strings as they are, anything else as JSON."""
    if v is None or isinstance(v, int | float | str | bool):
        return v
    return json.dumps(v)
