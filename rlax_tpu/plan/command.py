"""``python -m rlax_tpu.plan``: flags -> the programs' roofline -> costs -> predictions -> a table."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu.config import RunConfig
from rlax_tpu.plan.calibrate import describe, measure
from rlax_tpu.plan.costs import (
    GBPS,
    Efficiency,
    Network,
    PlanCosts,
    Roofline,
    Workload,
    plan_costs,
    verifier_slots,
    with_eval,
)
from rlax_tpu.plan.lengths import GroupLengths, parse
from rlax_tpu.plan.predict import Prediction, predict


class PlanError(ValueError):
    """Flags, a config or reports the planner cannot use (exit code 2)."""


def read_reports(paths: Sequence[str], topologies: dict[str, str]) -> Roofline:
    """The roofline seconds of every program in ``paths`` (``python -m rlax_tpu.aot --json``
    files). ``topologies``: component -> the topology its programs must have been compiled for."""
    seconds: dict[str, float] = {}
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            programs = report["programs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlanError(
                f"--aot {path}: not a report of python -m rlax_tpu.aot --json ({e})"
            ) from None
        for p in programs:
            want = topologies[p["component"]]
            if re.sub(r"^\d+x(?=v)", "", p["topology"]) != want:  # "2xv5p:4x4x4": 2 slices
                raise PlanError(
                    f"--aot {path}: {p['name']} was compiled for {p['topology']}, not {want}"
                )
            seconds[p["name"]] = _fitting(p["name"], p["status"], p["topology"], p["roofline_s"])
    return Roofline(seconds)


def compile_roofline(config: RunConfig, topologies: dict[str, str]) -> Roofline:
    from rlax_tpu.aot.report import CheckError, compile_reports

    try:
        reports, _ = compile_reports(
            config,
            topology=topologies["trainer"],
            inference_topology=topologies["inference"],
            component="all",
            progress=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    except CheckError as e:
        raise PlanError(str(e)) from None
    return Roofline({r.name: _fitting(r.name, r.status, r.topology, r.roofline_s) for r in reports})


def _fitting(name: str, status: str, topology: str, seconds: float) -> float:
    if status != "fits":
        raise PlanError(
            f"{name} {status} on {topology}: a plan for a layout that cannot run is void "
            "(python -m rlax_tpu.aot says why)"
        )
    return float(seconds)


def _floats(items: Sequence[str], what: str) -> list[float]:
    try:
        return [float(x) for x in items]
    except ValueError:
        raise PlanError(f"{what}: numbers expected, got {','.join(items)}") from None


def parse_efficiency(items: Sequence[str]) -> Efficiency:
    values: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("train", "decode", "prefill"):
            raise PlanError(f"--efficiency: train=E, decode=E or prefill=E expected, got {item!r}")
        values[key] = _floats([value], "--efficiency")[0]
    try:
        return Efficiency(**values)
    except ValueError as e:
        raise PlanError(f"--efficiency: {e}") from None


def plan(
    config: RunConfig,
    *,
    trainer_topology: str,
    inference_topology: str,
    workers: Sequence[str] = (),
    aot: Sequence[str] = (),
    calibrate: str = "",
    parallel_workers: float = 0.0,
    lengths: Sequence[str] = (),
    efficiency: Sequence[str] = (),
    pull_gbps: float = 100.0,
    server_gbps: float = 32.0,
    relay_efficiency: float = 0.97,
    delta_ratio: float = 1.0,
    check_s: float | None = None,
    length_dist: str = "",
    steps: int = 100,
    env_reply_s: float = 0.0,
) -> tuple[str, dict[str, Any]]:
    """The table and the JSON of the predictions (flags as ``__main__`` documents them)."""
    if not (math.isfinite(env_reply_s) and env_reply_s >= 0):
        raise PlanError("--env_reply_s must be a finite number >= 0")
    counts = [int(n) for n in _floats(workers, "--workers")] or [config.inference.num_workers]
    if min(counts) < 1:
        raise PlanError("--workers: counts must be >= 1")
    if parallel_workers < 0:
        raise PlanError("--parallel_workers must be >= 0 (0: every worker on chips of its own)")
    parallel = parallel_workers or float("inf")
    if calibrate:
        if lengths or efficiency:
            raise PlanError(
                "--calibrate measures the costs on a run: --lengths and --efficiency do not apply"
            )
        try:
            measured = measure(calibrate, config)
        except (OSError, ValueError) as e:
            raise PlanError(f"--calibrate: {e}") from None
        workload = measured.workload

        def cost_of(n: int) -> PlanCosts:
            c = measured.costs(config, workers=n, parallel_workers=parallel)
            return c if check_s is None else dataclasses.replace(c, check_s=check_s)

        check = cost_of(1).check_s

        source: dict[str, Any] = {"calibrated_on": str(calibrate)} | describe(measured)
        if aot:  # the run's own layout: what fraction of its rooflines the run reached
            roofline_of, *_ = _from_rooflines(
                config,
                trainer_topology=trainer_topology,
                inference_topology=inference_topology,
                aot=aot,
                lengths=[str(workload.prompt), str(workload.completion)],
                efficiency=["train=1", "decode=1", "prefill=1"],
                pull_gbps=pull_gbps,
                server_gbps=server_gbps,
                check_s=check_s,
                parallel=parallel,
            )
            source["measured_efficiency"] = measured_efficiency(
                roofline_of(1), cost_of(1), pushed_in_step=not config.trainer.publish_in_flight
            )
    else:
        cost_of, workload, check, source = _from_rooflines(
            config,
            trainer_topology=trainer_topology,
            inference_topology=inference_topology,
            aot=aot,
            lengths=lengths,
            efficiency=efficiency,
            pull_gbps=pull_gbps,
            server_gbps=server_gbps,
            relay_efficiency=relay_efficiency,
            delta_ratio=delta_ratio,
            check_s=check_s,
            parallel=parallel,
        )
    lengths = _lengths(config, length_dist, workload, measured.lengths if calibrate else None)
    predictions: list[Prediction] = []
    for n in counts:
        try:
            costs = dataclasses.replace(
                with_eval(config, cost_of(n), n, lengths), env_reply_s=env_reply_s
            )
            predictions.append(
                predict(config, costs, workload, workers=n, steps=steps, lengths=lengths)
            )
        except (KeyError, ValueError) as e:
            raise PlanError(str(e).strip("'\"")) from None
    k = config.data.eval_every
    assumptions = source | {
        "mode": config.controller.mode,
        "prompt_tokens": workload.prompt,
        "completion_tokens": workload.completion,
        "check_s": check,
        "env_reply_s": env_reply_s if config.environment.name != "none" else "no environment",
        "verifier_slots": verifier_slots(config),
        "parallel_workers": parallel_workers or "every worker on its own chips",
        "lengths": lengths.describe if lengths else "fixed (every sample the mean length)",
        "evaluations": (
            f"every {k} updates, {predictions[0].costs.eval_s:.1f} s at {counts[0]} worker(s)"
            if k > 0
            else "only at the start and the end (data.eval_every 0)"
        ),
    }
    return format_table(predictions, assumptions, config), {
        "preset": config.preset,
        "assumptions": assumptions,
        "predictions": [p.to_dict() for p in predictions],
    }


def _lengths(
    config: RunConfig, spec: str, workload: Workload, calibrated: GroupLengths | None
) -> GroupLengths | None:
    """--length_dist (default: the groups a calibration run trained after its warm-up, the ones
    its costs were measured with; None: every sample the mean)."""
    if not spec:
        return calibrated
    try:
        return parse(
            spec,
            mean=workload.completion,
            group_size=config.algorithm.group_size,
            cap=config.inference.max_new_tokens,
            seed=config.controller.seed,
        )
    except (ValueError, OSError) as e:  # NoLengths is a ValueError
        raise PlanError(f"--length_dist: {e}") from None


def _from_rooflines(
    config: RunConfig,
    *,
    trainer_topology: str,
    inference_topology: str,
    aot: Sequence[str],
    lengths: Sequence[str],
    efficiency: Sequence[str],
    pull_gbps: float,
    server_gbps: float,
    check_s: float | None,
    parallel: float,
    relay_efficiency: float = 0.97,
    delta_ratio: float = 1.0,
) -> tuple[Callable[[int], PlanCosts], Workload, float, dict[str, Any]]:
    """Costs from the AOT programs' rooflines: (costs of N workers, workload, check_s, the
    assumptions)."""
    from rlax_tpu.trainer.aot import micro_batch_shape

    if not trainer_topology or not inference_topology:
        raise PlanError(
            "the config names no TPU topology (topology.trainer_tpu / inference_tpu): pass "
            "--trainer_topology and --inference_topology, or --calibrate=RUN_DIR"
        )
    if lengths:
        if len(lengths) != 2:
            raise PlanError("--lengths: PROMPT,COMPLETION expected")
        prompt, completion = _floats(lengths, "--lengths")
        try:
            workload = Workload(prompt=prompt, completion=completion)
        except ValueError as e:
            raise PlanError(f"--lengths: {e}") from None
    else:
        workload = Workload.half_budget(config)
    eff = parse_efficiency(efficiency)
    if not (pull_gbps > 0 and server_gbps > 0):
        raise PlanError("--pull_gbps and --server_gbps must be > 0")
    if not 0 < relay_efficiency <= 1:
        raise PlanError("--relay_efficiency must be in (0, 1]")
    if not 0 < delta_ratio <= 1:
        raise PlanError("--delta_ratio must be in (0, 1]")
    network = Network(
        pull_bytes_per_s=pull_gbps * GBPS,
        server_bytes_per_s=server_gbps * GBPS,
        relay_efficiency=relay_efficiency,
        delta_ratio=delta_ratio,
    )
    topologies = {"trainer": trainer_topology, "inference": inference_topology}
    roofline = read_reports(aot, topologies) if aot else compile_roofline(config, topologies)
    rows, columns, _ = micro_batch_shape(config)
    check = config.verifiers.time_limit_s if check_s is None else check_s
    if check < 0:
        raise PlanError("--check_s must be >= 0")

    def cost_of(n: int) -> PlanCosts:
        c = plan_costs(
            config,
            roofline,
            workload=workload,
            efficiency=eff,
            network=network,
            workers=n,
            compiled_rows=rows,
            compiled_columns=columns,
            check_s=check,
        )
        return dataclasses.replace(c, group_s=c.group_s * max(1.0, n / parallel))

    source = {
        "trainer_topology": trainer_topology,
        "inference_topology": inference_topology,
        "efficiency": {"train": eff.train, "decode": eff.decode, "prefill": eff.prefill},
        "pull_gbps": pull_gbps,
        "server_gbps": server_gbps,
        "param_server_replicas": config.param_server.replicas,
        "fanout": config.param_server.fanout,
    }
    if config.param_server.fanout == "relay":
        source["relay_efficiency"] = relay_efficiency
        if config.param_server.relay_deltas > 1:
            source["relay_deltas"] = config.param_server.relay_deltas
            source["delta_ratio"] = delta_ratio
    return cost_of, workload, check, source


def measured_efficiency(
    roofline: PlanCosts, measured: PlanCosts, *, pushed_in_step: bool = True
) -> dict[str, float]:
    """The fraction of the rooflines (at efficiency 1) a run reached: for the update (its push
    left out, as the rooflines do not time it; ``pushed_in_step`` False: the run's steps did
    not wait for their pushes, trainer.publish_in_flight) and a group's generation. Pass them
    as ``--efficiency`` to plan another layout from this run."""
    update = measured.train_s - (roofline.detail["push_s"] if pushed_in_step else 0.0)
    if update <= 0:
        raise PlanError(
            f"the run's update ({measured.train_s:.2f} s) is shorter than the push the "
            f"network assumptions give ({roofline.detail['push_s']:.2f} s): check --server_gbps"
        )
    # A group's time at the mean lengths, alone on its worker: the rooflines' and the run's.
    return {
        "train": roofline.detail["update_s"] / update,
        "generate": roofline.group_s / measured.group_core_s,
    }


def format_table(
    predictions: Sequence[Prediction], assumptions: dict[str, Any], config: RunConfig
) -> str:
    c = predictions[0].costs
    g, rows = config.algorithm.group_size, config.inference.max_concurrent_seqs
    lines: list[str] = [
        "assumptions: "
        + ", ".join(
            f"{k} {v}"
            if not isinstance(v, dict)
            else f"{k} " + ", ".join(f"{a} {b}" for a, b in v.items())
            for k, v in assumptions.items()
        ),
    ]
    if "groups_per_s" in c.detail:
        lines.append(
            f"measured: train {c.train_s:.2f} s an update, a sample's check {c.check_s:.3f} s "
            f"({c.verifier_slots} sandboxes), a load "
            f"{c.reload_s:.2f} s, a worker {c.detail['groups_per_s']:.3f} groups/s ({c.slots} "
            "at once)"
        )
    else:
        lines.append(
            f"per update: train {c.train_s:.2f} s (update {c.detail['update_s']:.2f} s over "
            f"{c.detail['micro_batches']:.0f} micro-batches, push {c.detail['push_s']:.2f} s of "
            f"{c.version_bytes / 2**30:.2f} GiB); per group: {c.group_s:.2f} s on a worker "
            f"({c.slots} at once, decode step {1e3 * c.detail['decode_step_s']:.2f} ms)"
        )
    if c.slots * g < rows - g + 1:
        lines.append(
            f"note: a worker's KV pages hold {c.slots} group(s) of {g} at these lengths, "
            f"{c.slots * g} of its {rows} decode rows: raise inference.kv_cache_bytes (what "
            "python -m rlax_tpu.aot says fits) or lower inference.max_concurrent_seqs"
        )
    lines += [
        "",
        f"{'workers':>7}  {'s/update':>9}  {'tokens/s':>10}  {'trainer':>7}  {'workers':>7}  "
        f"{'verifier':>8}  {'reload s':>8}  {'staleness':>9}  {'max':>3}  {'discarded':>9}  bottleneck",
    ]
    for p in predictions:
        lines.append(
            f"{p.workers:>7}  {p.seconds_per_update:>9.2f}  {p.tokens_per_s:>10.0f}  "
            f"{100 * p.trainer_busy:>6.0f}%  {100 * p.workers_busy:>6.0f}%  "
            f"{100 * p.verifier_busy:>7.0f}%  "
            f"{p.costs.reload_s:>8.2f}  {p.mean_staleness:>9.2f}  {max(p.staleness):>3}  "
            f"{p.discarded:>9}  {p.bottleneck}"
        )
    return "\n".join(lines)
