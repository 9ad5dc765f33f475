"""The controller: the main job that drives inference workers, verifiers, trainer and parameter server.

    python -m rlax_tpu.controller --config=configs/codeforces.py[:local|v5p] [--config.a.b=value ...]

Without a preset it picks the one that fits this machine (local on CPU). A run directory that
holds snapshots is resumed; a finished run is left as it is.
"""

from __future__ import annotations

import sys

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    from absl import logging as absl_logging

    from rlax_tpu.controller.app import run_job
    from rlax_tpu.controller.loop import IncompatibleResume
    from rlax_tpu.data.problems import DataError
    from rlax_tpu.rpc.transport import ComponentUnreachable

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
    if args:
        print(f"rlax_tpu.controller: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    try:
        run_job(config, command="python -m rlax_tpu.controller " + " ".join(sys.argv[1:]))
    except (IncompatibleResume, DataError, ComponentUnreachable) as e:
        print(f"rlax_tpu.controller: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    cli.main("controller", run)
