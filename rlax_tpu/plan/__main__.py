"""Plan a run before renting it: predicted seconds per update, tokens/s, utilization, staleness
and the bottleneck of a config on a TPU layout, for one or several inference worker counts.

    python -m rlax_tpu.plan --config=configs/codeforces.py:v5p --workers=8,16,32,64
    python -m rlax_tpu.plan --config=configs/codeforces.py:v5p --workers=32 \\
        --aot=benchmarks/aot/v5p-trainer-v5p_4x8x8.json,benchmarks/aot/v5p-inference-v5p_2x2x1.json
    python -m rlax_tpu.plan --config=configs/codeforces.py:local --calibrate=runs/local \\
        --workers=1,2,3,4 --parallel_workers=1

--trainer_topology / --inference_topology   default: the config's topology.trainer_tpu / inference_tpu
--workers=N[,N...]    inference workers (default: inference.num_workers)
--aot=A.json[,B.json] the programs' reports (``python -m rlax_tpu.aot --json``) instead of
                      compiling them here (which needs libtpu and takes minutes for large models)
--calibrate=RUN_DIR   the costs measured on a deterministic-mode run of this config (its
                      metrics.jsonl) instead of the rooflines; no topology needed. With --aot
                      of the run's own layout, also the efficiency the run reached
--parallel_workers=K  workers that generate at full speed at once (default 0: each has chips
                      of its own; 1 for workers sharing this host's one inference core). With
                      --calibrate, the verifier's sandboxes share those K cores too
--lengths=P,C         mean prompt and completion tokens (default: half of each budget)
--efficiency=train=E,decode=E,prefill=E   measured time = roofline / efficiency (default 0.5 each)
--relay_efficiency=E  with param_server.fanout=relay, the share of its link a relayed version
                      gets (default 0.97, measured)
--delta_ratio=R       with param_server.relay_deltas > 1, a relayed delta's bytes over the
                      version's, against the base a reloading worker holds (default 1: no
                      saving; measure a run's: benchmarks/weight_sync.py deltas)
--pull_gbps / --server_gbps   a worker's pull bandwidth; a parameter-server replica's
--check_s             a sample's verification on one sandbox (default: verifiers.time_limit_s;
                      with --calibrate, the run's); the verifier has verifiers.workers x
                      topology.verifier_replicas sandboxes
--env_reply_s=S       seconds an environment takes to reply to one turn (multi-turn episodes,
                      environment.name set; default 0): waits per environment.schedule
                      (plan/costs.py env_wait_s)
--length_dist=D       completion lengths a group draws: fixed (every sample the mean),
                      lognormal:CV (the mean completion, coefficient of variation CV, cut at
                      max_new_tokens) or run:RUN_DIR (a run's trained groups); default: the
                      --calibrate run's groups when its metrics have them, else fixed
--steps               updates simulated (default 100; the first tenth is warm-up)
--json=PATH           also write the predictions as JSON

How each cost is made, and what is not modelled, is in ``plan/costs.py`` and ``plan/predict.py``.
Exit codes: 0 planned; 2 bad flags or config, or reports that do not match it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from rlax_tpu import cli
from rlax_tpu.config import RunConfig

flags.DEFINE_string("trainer_topology", None, "The trainer's TPU slice (default: the config's).")
flags.DEFINE_string("inference_topology", None, "A worker's TPU slice (default: the config's).")
flags.DEFINE_list("workers", [], "Inference worker counts to plan for (default: the config's).")
flags.DEFINE_list("aot", [], "JSON reports of python -m rlax_tpu.aot instead of compiling.")
flags.DEFINE_string("calibrate", "", "A deterministic-mode run directory to measure costs on.")
flags.DEFINE_float(
    "parallel_workers",
    0.0,
    "Workers that generate at full speed at once (0: all of them); with --calibrate, the cores "
    "they share with the verifier's sandboxes.",
)
flags.DEFINE_list("lengths", [], "Mean prompt and completion tokens: P,C.")
flags.DEFINE_list("efficiency", [], "train=E,decode=E,prefill=E (fractions of the roofline).")
flags.DEFINE_float("pull_gbps", 100.0, "A worker's pull bandwidth, Gbit/s.")
flags.DEFINE_float("server_gbps", 32.0, "A parameter-server replica's bandwidth, Gbit/s.")
flags.DEFINE_float(
    "relay_efficiency",
    0.97,
    "With param_server.fanout=relay: the share of its link a relayed version gets (measured "
    "0.97-0.98 against an emulated NIC, benchmarks/RESULTS.md 'Weight sync').",
)
flags.DEFINE_float(
    "delta_ratio",
    1.0,
    "With param_server.relay_deltas > 1: a relayed delta's bytes over the whole version's "
    "(measured 0.05 against the version before, 0.36 against one 16 older, RESULTS (c)).",
)
flags.DEFINE_float("check_s", None, "Seconds to verify a sample on a sandbox.")
flags.DEFINE_float("env_reply_s", 0.0, "Seconds an environment takes to reply to a turn.")
flags.DEFINE_string("length_dist", "", "fixed, lognormal:CV or run:RUN_DIR.")
flags.DEFINE_integer("steps", 100, "Updates to simulate.")
flags.DEFINE_string("json", None, "Write the predictions to this JSON file.")
FLAGS = flags.FLAGS


def run(config: RunConfig, args: list[str]) -> int:
    from rlax_tpu.plan.command import PlanError, plan

    if args:
        print(f"rlax_tpu.plan: unexpected arguments {args}", file=sys.stderr)
        return cli.EXIT_USAGE
    try:
        table, out = plan(
            config,
            trainer_topology=FLAGS.trainer_topology or config.topology.trainer_tpu,
            inference_topology=FLAGS.inference_topology or config.topology.inference_tpu,
            workers=FLAGS.workers,
            aot=FLAGS.aot,
            calibrate=FLAGS.calibrate,
            parallel_workers=FLAGS.parallel_workers,
            lengths=FLAGS.lengths,
            efficiency=FLAGS.efficiency,
            pull_gbps=FLAGS.pull_gbps,
            server_gbps=FLAGS.server_gbps,
            relay_efficiency=FLAGS.relay_efficiency,
            delta_ratio=FLAGS.delta_ratio,
            check_s=FLAGS.check_s,
            env_reply_s=FLAGS.env_reply_s,
            length_dist=FLAGS.length_dist,
            steps=FLAGS.steps,
        )
    except PlanError as e:
        print(f"rlax_tpu.plan: error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    print(table)
    if FLAGS.json:
        path = Path(FLAGS.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        out["command"] = "python -m rlax_tpu.plan " + " ".join(sys.argv[1:])
        path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    if not any(a.startswith("--config.controller.bucket=") for a in sys.argv):
        # Planning reads no storage: a preset's "{bucket}" paths need none.
        sys.argv.append("--config.controller.bucket=unused-by-the-planner")
    cli.main("plan", run)
