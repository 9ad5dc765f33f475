"""Compile a config's trainer and inference programs for a TPU topology, without a TPU, and
report per device: memory against HBM, FLOPs, bytes accessed and a roofline time.

    python -m rlax_tpu.aot --config=configs/codeforces.py:v5p --topology=v5p:4x8x8 \\
        --inference_topology=v5p:2x2x1
    python -m rlax_tpu.aot --config=configs/codeforces.py:local --topology=v5e:2x2 --component=trainer

--topology          the trainer's slice (and the inference workers', unless --inference_topology)
--component         trainer, inference or all (default)
--programs=A,B      only these programs (names as the report gives them, e.g. trainer.accumulate)
--json=PATH         also write every program's numbers as JSON

The model and optimizer state are built abstractly (no weights are read or allocated) and the
project's own jitted functions are lowered on them: the trainer's gradient step at the largest
micro-batch the config allows, its optimizer update, the π_old / π_ref / value scoring the
config turns on, the publish cast, and the inference engine's decode, prefill and page-copy
programs with the TPU Pallas attention kernel. libtpu (``pip install -e '.[tpu]'``) compiles
them; its warnings about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES on a machine without TPUs
are harmless.

Exit codes: 0 every program compiles and fits; 1 one does not (one line per program says which
and by how much); 2 bad flags or config, or a mesh that does not fit the topology.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import flags

from rlax_tpu import cli
from rlax_tpu.config import RunConfig, libtpu

COMPONENTS = ("trainer", "inference", "all")
flags.DEFINE_string("topology", None, "TPU topology to compile for, e.g. v5e:2x2, v5p:4x8x8.")
flags.DEFINE_string(
    "inference_topology", None, "The inference workers' slice (default: --topology)."
)
flags.DEFINE_enum("component", "all", COMPONENTS, "Which component's programs to compile.")
flags.DEFINE_list(
    "programs", [], "Compile only these programs (e.g. trainer.accumulate,trainer.apply)."
)
flags.DEFINE_string("json", None, "Write the reports to this JSON file.")
FLAGS = flags.FLAGS


def run(config: RunConfig, args: list[str]) -> int:
    from rlax_tpu.aot.report import run_check

    if args:
        print(f"rlax_tpu.aot: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    if not FLAGS.topology:
        print(
            "rlax_tpu.aot: error: --topology is required (e.g. --topology=v5e:2x2)", file=sys.stderr
        )
        return cli.EXIT_USAGE
    try:
        apply_libtpu_init_args(config, FLAGS.component)
    except cli.UsageError as e:
        print(f"rlax_tpu.aot: error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    return run_check(
        config,
        topology=FLAGS.topology,
        inference_topology=FLAGS.inference_topology or FLAGS.topology,
        component=FLAGS.component,
        json_path=Path(FLAGS.json) if FLAGS.json else None,
        command="python -m rlax_tpu.aot " + " ".join(_COMMAND),
        only=FLAGS.programs,
    )


def apply_libtpu_init_args(config: RunConfig, component: str = "all") -> None:
    """The TPU jobs' XLA flags (config/libtpu.py; with every component, the trainer's) for
    libtpu, which reads them when its plugin loads (here: at the first topology), so that the
    check compiles what the jobs run. A LIBTPU_INIT_ARGS already in the environment is kept
    (and said so); a libtpu already loaded (a JAX_PLATFORMS other than the check's "cpu" and a
    preset that asked for devices) is an error, as its flags are fixed by then."""
    from jax._src.lib import xla_client

    wanted = libtpu.libtpu_init_args(config, component)
    if xla_client.pjrt_plugin_loaded("tpu"):
        raise cli.UsageError(
            f"libtpu was loaded before the check could set {libtpu.ENV}: run it with "
            "JAX_PLATFORMS=cpu (its default)"
        )
    have = os.environ.setdefault(libtpu.ENV, wanted)
    if have != wanted:
        print(
            f"note: {libtpu.ENV} from the environment ({have!r}) is used, not the config's "
            f"topology.libtpu_init_args ({wanted!r})",
            file=sys.stderr,
        )


_COMMAND = sys.argv[1:]  # as the user typed it (for the report)

if __name__ == "__main__":
    if not any(a.startswith("--config.controller.bucket=") for a in sys.argv):
        # The check compiles programs and reads no storage: a preset's "{bucket}" paths need none.
        sys.argv.append("--config.controller.bucket=unused-by-the-aot-check")
    cli.main("aot", run)
