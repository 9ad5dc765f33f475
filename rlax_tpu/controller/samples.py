"""The training samples of an update (observability.samples_per_step): rollouts drawn from its
batch, as text, with what the objective made of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlax_tpu.controller.groups import GroupResult
from rlax_tpu.types import Rollout


def turns(rollout: Rollout, decode: Callable[[np.ndarray], str]) -> list[dict[str, str]]:
    """An episode's turns in order: runs of the model's sampled tokens ("model") and of the
    environment's replies ("environment"), each decoded."""
    sampled = np.asarray(rollout.sampled, bool)
    edges = [0, *(np.flatnonzero(sampled[1:] != sampled[:-1]) + 1).tolist(), len(sampled)]
    return [
        {
            "role": "model" if sampled[a] else "environment",
            "text": decode(np.asarray(rollout.tokens)[a:b]),
        }
        for a, b in zip(edges[:-1], edges[1:], strict=True)
        if b > a
    ]


def draw(
    groups: Sequence[GroupResult],
    advantages: np.ndarray | None,
    *,
    k: int,
    seed: int,
    step: int,
    version: int,
    decode: Callable[[np.ndarray], str],
) -> list[dict[str, Any]]:
    """``k`` rollouts of an update's batch (``groups`` in the batch's order, each of its group's
    rows in sample order), drawn by ``seed`` and ``step``; ``advantages``: [rows] the trainer's
    per-row mean advantage (None: not known). ``version``: the weights the update started from
    (staleness is counted against it)."""
    rows = [(g, i) for g in groups for i in range(len(g.rollouts))]
    if not rows or k <= 0:
        return []
    rng = np.random.default_rng([seed, step])
    chosen = sorted(rng.choice(len(rows), size=min(k, len(rows)), replace=False).tolist())
    have_advantages = advantages is not None and len(advantages) == len(rows)
    out = []
    for row in chosen:
        g, i = rows[row]
        ro = g.rollouts[i]
        versions = np.asarray(ro.versions)
        sample: dict[str, Any] = {
            "step": step,
            "group": g.key,
            "sample": int(ro.sample_index),
            "prompt": decode(np.asarray(ro.prompt_tokens)),
            "completion": decode(np.asarray(ro.tokens)),
            "reward": float(g.rewards[i]),
            "advantage": float(advantages[row]) if have_advantages else None,
            "verdict": g.verdicts[i],
            "versions": sorted({int(v) for v in versions[versions >= 0]}),
            "staleness": version - ro.version if len(ro.tokens) else 0,
            "finish_reason": ro.finish_reason.value,
            "tokens": len(ro.tokens),
        }
        if ro.sampled is not None:
            sample["turns"] = turns(ro, decode)
        out.append(sample)
    return out
