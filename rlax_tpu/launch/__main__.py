"""Runs the whole topology of a config on this machine: every component its own process.

    python -m rlax_tpu.launch --config=configs/codeforces.py:local [--config.a.b=value ...]

Starts the parameter-server replicas, the trainer (trainer.distributed.num_processes processes),
the inference workers (inference.num_workers, each inference.distributed.num_processes processes)
and the verifier service, each listening on 127.0.0.1, then the controller over the distributed
transport, as a cluster deployment runs them. A supervised warm-up (controller.warmup_steps)
runs first and the services start from its weights (<run_dir>/warmup). Output of every process is
in <run_dir>/logs/<name>.log and on stdout prefixed with its name. The exit status is the
controller's (1 if a service failed); when it ends, every process it started is stopped.
Rerunning it on the same run directory resumes the run.
"""

from __future__ import annotations

import sys

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    from rlax_tpu.launch.local import Launch

    if args:
        print(f"rlax_tpu.launch: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    config_args = [a for a in sys.argv[1:] if a.startswith("--config=") or a.startswith("--config.")]
    if not any(a.startswith("--config=") for a in config_args):
        config_args.insert(0, f"--config={cli.DEFAULT_CONFIG}")
    return Launch(config, config_args).run()


if __name__ == "__main__":
    cli.main("launch", run)
