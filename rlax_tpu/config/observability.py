"""The observability section: where a run's metrics go besides metrics.jsonl (rlax_tpu/observability)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Literal

from rlax_tpu.config.checks import ConfigError, frozen, non_negative

SINKS = ("tensorboard", "wandb")
# Sinks user code registered (rlax_tpu.observability.sinks.register_sink), from modules named in
# algorithm.plugins.
_REGISTERED_SINKS: list[str] = []


def register_sink_name(name: str) -> None:
    """Makes ``name`` a valid entry of observability.sinks (called by sinks.register_sink)."""
    if name in SINKS:
        raise ValueError(f"{name!r} is a built-in sink; register another name")
    if name not in _REGISTERED_SINKS:
        _REGISTERED_SINKS.append(name)


def known_sinks() -> tuple[str, ...]:
    return (*SINKS, *_REGISTERED_SINKS)


@frozen
class WandbConfig:
    # Weights & Biases (sink "wandb"). Credentials come from W&B's own environment
    # (WANDB_API_KEY, or `wandb login`'s netrc); WANDB_MODE=offline in the environment wins
    # over mode.
    project: str = "rlax_tpu"
    entity: str = ""  # "": the credentials' default entity
    name: str = ""  # the run's display name; "": the run directory's name
    group: str = ""  # groups runs in the UI (e.g. the seeds of one experiment)
    tags: tuple[str, ...] = ()  # labels to filter runs by in the UI
    # online: uploads as it logs; offline: writes only the local directory (`wandb sync` it
    # later).
    mode: Literal["online", "offline"] = "online"
    # Where W&B keeps its local files (in its wandb/ there). "": the run directory; a gs://
    # run directory needs a local one here (W&B writes through the local file system).
    dir: str = ""


@frozen
class ObservabilityConfig:
    # Where every step's scalars and histograms go besides metrics.jsonl (always written, the
    # record reports and resumes read): tensorboard (<run_dir>/tensorboard), wandb, or a sink a
    # plugin registered. A sink that fails warns once and is dropped; the run goes on.
    sinks: tuple[str, ...] = ("tensorboard",)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    # Rollouts of each update written as text to <run_dir>/samples/step_<s>.jsonl and to the
    # sinks that show tables (prompt, completion, reward, advantage, versions, staleness, finish
    # reason, an episode's turns), drawn from the update's batch by controller.seed; 0: none.
    samples_per_step: int = 4
    # Updates (by the step they make, 1 = the first) to trace with jax.profiler on every process
    # of the trainer (its update) and of each worker (the wall interval from the previous
    # update's end to this one's), into <run_dir>/profiles/step_<s>/<host>.<pid>/ (TensorBoard's
    # profile plugin, XProf). A trace costs memory and time while it runs: pick a few steps
    # past the first (which compiles).
    profile_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        non_negative(self, "samples_per_step")
        if any(s < 1 for s in self.profile_steps):
            raise ConfigError("profile_steps", "steps are updates, 1 the first", self.profile_steps)
        if len(set(self.sinks)) != len(self.sinks):
            raise ConfigError("sinks", "names a sink twice", self.sinks)

    def check_sinks(self) -> None:
        """After algorithm.plugins are imported (RunConfig): they may register sinks."""
        known = known_sinks()
        for name in self.sinks:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = (
                    f"did you mean {close[0]!r}?"
                    if close
                    else f"built-in: {', '.join(SINKS)} (a sink of your own: name the module "
                    "that registers it in algorithm.plugins)"
                )
                raise ConfigError(
                    "observability.sinks", f"unknown sink {name!r}; {hint}", self.sinks
                )
