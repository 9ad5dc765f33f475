"""The controller: the main job that drives inference workers, verifiers, trainer and parameter server.

    python -m rlax_tpu.controller --config=configs/codeforces.py[:local|v5p] [--config.a.b=value ...]

Without a preset it picks the one that fits this machine (local on CPU).
"""

from __future__ import annotations

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    # Not built yet: say so instead of pretending (#11 [controller]).
    return cli.not_built("controller", "#11 [controller]", config)


if __name__ == "__main__":
    cli.main("controller", run)
