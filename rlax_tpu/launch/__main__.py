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

    python -m rlax_tpu.launch --config=configs/codeforces.py:v5p --config.controller.bucket=gs://B \
        --render=gke --out=deploy/gke/overlays/mine

writes the same config's deployment on GKE instead (a JobSet, Services, NetworkPolicies, as a
kustomize overlay on deploy/gke/base; apply with `kubectl apply -k DIR`). It refuses a config
whose endpoints, ports, credentials, process counts or meshes do not match what it deploys.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from rlax_tpu import cli
from rlax_tpu.config import RunConfig

RENDER = flags.DEFINE_enum(
    "render", None, ["gke"], "Write the deployment (a kustomize overlay) instead of running."
)
OUT = flags.DEFINE_string("out", None, "With --render: the overlay's folder.")


def run(config: RunConfig, args: list[str]) -> int:
    from rlax_tpu.launch.local import Launch

    if args:
        print(f"rlax_tpu.launch: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    config_args = cli.config_args(sys.argv[1:])
    if RENDER.value:
        return _render(config, config_args)
    if OUT.value:
        raise cli.UsageError("--out needs --render")
    return Launch(config, config_args).run()


def _render(config: RunConfig, config_args: list[str]) -> int:
    from rlax_tpu.launch.gke import RenderError
    from rlax_tpu.launch.render import write_overlay

    if not OUT.value:
        raise cli.UsageError("--render needs --out=DIR")
    try:
        written = write_overlay(config, config_args, Path(OUT.value))
    except RenderError as e:
        print(f"rlax_tpu.launch: error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    print(f"rlax_tpu.launch: wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    cli.main("launch", run)
