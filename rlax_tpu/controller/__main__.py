"""The controller: the main job that drives inference workers, verifiers, trainer and parameter server.

    python -m rlax_tpu.controller --config=configs/codeforces.py[:local|v5p] [--config.a.b=value ...]

Without a preset it picks the one that fits this machine (local on CPU). A run directory that
holds snapshots is resumed; a finished run is left as it is.

    python -m rlax_tpu.controller --config=... --warmup_out=DIR

runs only the supervised warm-up (controller.warmup_steps) and writes the warmed-up model to DIR
(HF safetensors + tokenizer), for services started apart that load it
(model.weights_format=safetensors, model.weights_path=DIR); `python -m rlax_tpu.launch` does this.

    python -m rlax_tpu.controller --config=... --evaluate=human_eval[,functions,...] [--evaluate_sample=N]

trains nothing: it evaluates the version a resume would take (no snapshot: the initial weights)
on every problem of the named datasets, e.g. HumanEval for a run that never trains on it, and
writes each sample with its verdict under <run_dir>/eval/<dataset>/ (controller/evaluate.py);
--evaluate_sample=N takes N problems of each, chosen by controller.seed.

Exit codes: 0 the run finished (or had), 1 a clear error, 2 bad flags or config, 143 stopped by
SIGTERM (the same command resumes it).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

from absl import flags

from rlax_tpu import cli
from rlax_tpu.config import RunConfig

WARMUP_OUT = flags.DEFINE_string(
    "warmup_out", None, "Run only the supervised warm-up and write its weights to this folder."
)

EVALUATE = flags.DEFINE_list(
    "evaluate",
    None,
    "Train nothing: evaluate the run's newest version on every problem of these datasets.",
)

EVALUATE_SAMPLE = flags.DEFINE_integer(
    "evaluate_sample",
    0,
    "With --evaluate: a choice of this many problems per dataset, seeded by controller.seed "
    "(0: every problem).",
)

# SIGTERM (a drained node, `kubectl delete`, deploy/tpu_vm/stop.sh) stops the run with this code.
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):  # noqa: N818 - like KeyboardInterrupt: no `except Exception` stops it
    """Raised in the main thread by SIGTERM."""


_STOP_GRACE_S = [0.0]  # controller.stop_grace_s of the run (0: unbounded)


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    if _STOP_GRACE_S[0] > 0:
        stopper = threading.Timer(_STOP_GRACE_S[0], _stop_now, args=(_STOP_GRACE_S[0],))
        stopper.daemon = True  # it must not keep the process alive itself
        stopper.start()
    raise Terminated


def _stop_now(grace_s: float) -> None:
    """The process outlived its stop grace after SIGTERM: say where every thread is, and go."""
    print(
        f"rlax_tpu.controller: still running {grace_s:.0f} s after SIGTERM "
        "(controller.stop_grace_s); the threads' stacks follow, then the process exits",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_TERMINATED)


def _finished(config: RunConfig) -> bool:
    from rlax_tpu import storage
    from rlax_tpu.controller.snapshots import SnapshotStore

    cc = config.controller
    store = SnapshotStore(storage.path(cc.run_dir) / "snapshots", keep=cc.snapshot_keep)
    latest = store.latest_step()
    return latest is not None and latest >= cc.num_steps


def run(config: RunConfig, args: list[str]) -> int:
    if args:
        print(f"rlax_tpu.controller: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    names = EVALUATE.value or []
    if EVALUATE.present and (not names or not all(names) or WARMUP_OUT.value):
        why = "and --warmup_out do not go together" if names and all(names) else "names no dataset"
        print(f"rlax_tpu.controller: error: --evaluate={','.join(names)} {why}", file=sys.stderr)
        return cli.EXIT_USAGE
    if EVALUATE_SAMPLE.value < 0 or (EVALUATE_SAMPLE.value and not EVALUATE.present):
        print(
            f"rlax_tpu.controller: error: --evaluate_sample={EVALUATE_SAMPLE.value} needs "
            "--evaluate and a count >= 0",
            file=sys.stderr,
        )
        return cli.EXIT_USAGE
    # Imported once the flags are known good: a usage error answers at once (JAX and the
    # components take about 2 s of CPU to import).
    from absl import logging as absl_logging

    from rlax_tpu.controller.app import run_job
    from rlax_tpu.controller.loop import IncompatibleResume, NothingToLearn
    from rlax_tpu.data.problems import DataError
    from rlax_tpu.rpc.transport import ComponentFailed, ComponentUnreachable

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
    # SIGTERM abandons the step in flight (the newest snapshot says what to re-issue, so nothing
    # is lost or trained twice), closes the components as an error would, and exits
    # EXIT_TERMINATED, or 0 if the run had finished.
    _STOP_GRACE_S[0] = config.controller.stop_grace_s
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if WARMUP_OUT.value:
            if not config.controller.warmup_steps:
                print(
                    "rlax_tpu.controller: error: --warmup_out needs controller.warmup_steps > 0",
                    file=sys.stderr,
                )
                return cli.EXIT_USAGE
            from rlax_tpu.controller.app import export_warmup

            export_warmup(config, WARMUP_OUT.value)
            return 0
        if EVALUATE.present:
            from rlax_tpu.controller.evaluate import evaluate_job

            try:
                evaluate_job(config, EVALUATE.value, sample=EVALUATE_SAMPLE.value)
            except ValueError as e:  # DataError is one: the same message
                print(f"rlax_tpu.controller: error: {e}", file=sys.stderr)
                return 1
            return 0
        run_job(config, command="python -m rlax_tpu.controller " + " ".join(sys.argv[1:]))
    except (
        IncompatibleResume,
        NothingToLearn,
        DataError,
        ComponentUnreachable,
        ComponentFailed,
    ) as e:
        print(f"rlax_tpu.controller: error: {e}", file=sys.stderr)
        return 1
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if EVALUATE.present:
            print("rlax_tpu.controller: --evaluate stopped by SIGTERM", file=sys.stderr)
            return EXIT_TERMINATED
        if not WARMUP_OUT.value and _finished(config):
            print("rlax_tpu.controller: stopped by SIGTERM after the run finished", file=sys.stderr)
            return 0
        print(
            "rlax_tpu.controller: stopped by SIGTERM; the same command resumes the run from "
            f"its newest snapshot in {config.controller.run_dir}",
            file=sys.stderr,
        )
        return EXIT_TERMINATED
    return 0


if __name__ == "__main__":
    cli.main("controller", run)
