"""What one update and one group cost on a TPU layout, from the AOT check's programs.

Each program's roofline (``python -m rlax_tpu.aot``: per device, the slower of its FLOPs at the
chip's peak and its bytes at the peak HBM bandwidth) over an efficiency factor is its time:

* The update: prepare + m·f·(accumulate + π_old [+ π_ref]) + apply + publish cast, with
  m = ⌈B·G / rows⌉ micro-batches of the compiled ``rows`` and f = (prompt + completion) / the
  compiled micro-batch's columns (the trainer cuts micro-batches to length buckets), over
  ``Efficiency.train``. Then the push: every parameter-server replica receives the whole version
  (``param_server/client.py``), at ``Network.server_bytes_per_s``. In throughput mode with
  ``trainer.publish_in_flight`` the push runs beside the next update (the trainer's cycle is
  the slower of the two); that a version reaches the workers a push after its step is not
  modelled (the staleness is then underestimated by about push / update versions). In
  deterministic mode the push stays in the update's time (the next generation waits for it).
* A group on a worker: ``completion`` decode steps of the decode program at the worker's full
  batch, over ``Efficiency.decode``, and the prefill calls that stall them: its prompt's (the G
  samples share its pages, ``scheduler.py``; chunks of prefill_rows x prefill_len tokens a call,
  over ``Efficiency.prefill``) and, in the steady state, those of the ``slots`` - 1 groups that
  start while it runs. A worker holds ``slots`` groups at once: max_concurrent_seqs // G, or
  fewer when its KV pages cannot hold that many sequences of prompt + completion tokens.
* A reload: with ``param_server.fanout`` "replicas", the version's bytes at a worker's pull
  bandwidth, or at the replicas' egress shared by every worker loading at once (throughput mode
  reloads them together), whichever is slower. With "relay", a chain (``param_server/relay.py``):
  the root replica sends the version once and each worker forwards every bucket once it is
  verified, so the last of W workers has it (W - 1) buckets after the first, at the slower of the
  two links times ``Network.relay_efficiency``; when the chain runs beside the trainer's push
  (``RunConfig.relays_while_pushed``), what is left of it after the push, at least the last
  bucket's W hops (the version then reaches every worker in about the slower of the two
  transfers, not their sum). With ``param_server.relay_deltas`` N > 1, N - 1
  reloads in N are deltas against the version the worker holds: ``Network.delta_ratio`` of the
  bytes (measured on a run's versions: ``benchmarks/weight_sync.py deltas``), after the root's
  encoding of the whole version at ``Network.delta_encode_bytes_per_s``, which the reload waits
  for; the N-th is whole.
* Verification: ``check_s`` a sample on one of the verifier's sandboxes (verifiers.workers x
  topology.verifier_replicas of them), given (the rooflines say nothing of it).
* A held-out evaluation (data.eval_every > 0): its eval_problems x eval_samples samples as
  groups of G on every worker's slots, in waves of a group's time at the mean length, then
  verified on the sandboxes (``with_eval``). With eval_every 0 a run evaluates only at its start
  and end, outside the steady state.

Lengths are means: a group's time here is its mean sample's, which is what its slots are busy for
under continuous batching; its latency (its longest sample) is longer, so staleness is
underestimated when lengths vary widely.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rlax_tpu.config import RunConfig
from rlax_tpu.models.paged_cache import page_bytes
from rlax_tpu.plan.lengths import GroupLengths

GBPS = 1e9 / 8  # bytes/s of one Gbit/s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """Mean tokens of a sample: its prompt and its completion."""

    prompt: float
    completion: float

    def __post_init__(self) -> None:
        if not (self.prompt >= 1 and self.completion >= 1):
            raise ValueError(f"mean prompt and completion lengths must be >= 1, got {self}")

    @classmethod
    def half_budget(cls, config: RunConfig) -> Workload:
        """The default: half of the config's prompt and generation budgets."""
        icfg = config.inference
        return cls(prompt=icfg.max_prompt_len / 2, completion=icfg.max_new_tokens / 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Measured time = roofline time / efficiency, per kind of program (0 < e <= 1).

    The defaults are assumptions, not measurements: about half of the roofline for training
    (MaxText's published v5p MFU for dense models is in that range) and for batched decode and
    prefill. ``--calibrate`` measures them on a run."""

    train: float = 0.5
    decode: float = 0.5
    prefill: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {f.name} must be in (0, 1], got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Network:
    """Bandwidths of the weight traffic, bytes/s.

    Defaults: a worker host pulls at 100 Gbit/s, and a parameter-server replica (a CPU node,
    n2-highmem-64 in the GKE presets) sends and receives at 32 Gbit/s, N2's default per-VM egress
    limit for 32 vCPUs or more (https://cloud.google.com/compute/docs/network-bandwidth; Tier_1
    networking raises it to 100)."""

    pull_bytes_per_s: float = 100 * GBPS
    server_bytes_per_s: float = 32 * GBPS
    # The share of its link a relayed version gets: one worker received at 0.97-0.98 of an
    # emulated NIC's rate (benchmarks/RESULTS.md, "Weight sync" (b)).
    relay_efficiency: float = 0.97
    relay_bucket_bytes: int = 4 * 2**20  # param_server/relay.py BUCKET_BYTES
    # A relayed delta's bytes over the whole version's, against the base a reloading worker
    # holds (1: no saving). Measured over a SmolLM2 run in bf16 (RESULTS "Weight sync" (c)):
    # 0.049 against the version before, 0.36 against one 16 versions older.
    delta_ratio: float = 1.0
    # The root's encoding of a version against a base: about 1 GiB/s a core measured here
    # (RESULTS (c)), on the parameter server's 8 encoding threads.
    delta_encode_bytes_per_s: float = 8 * 2**30

    def __post_init__(self) -> None:
        if not (self.pull_bytes_per_s > 0 and self.server_bytes_per_s > 0):
            raise ValueError("bandwidths must be > 0")
        if not 0 < self.relay_efficiency <= 1:
            raise ValueError(f"relay_efficiency must be in (0, 1], got {self.relay_efficiency}")
        if not 0 < self.delta_ratio <= 1:
            raise ValueError(f"delta_ratio must be in (0, 1], got {self.delta_ratio}")
        if not self.delta_encode_bytes_per_s > 0:
            raise ValueError("delta_encode_bytes_per_s must be > 0")

    def reload_s(self, config: RunConfig, size: int, workers: int) -> float:
        """Seconds until every one of ``workers`` workers holds a version of ``size`` bytes
        (module docstring): with relay deltas, the mean over a whole reload and its deltas."""
        if config.param_server.fanout == "relay":
            rate = min(self.pull_bytes_per_s, self.server_bytes_per_s) * self.relay_efficiency

            def chain(nbytes: float) -> float:
                return (nbytes + (workers - 1) * min(nbytes, self.relay_bucket_bytes)) / rate

            whole = chain(size)
            if config.relays_while_pushed:
                # The chain runs beside the push (service.CutThrough): after the push, what is
                # left of it, at least the last bucket's way down the chain.
                whole = max(
                    whole - size / self.server_bytes_per_s,
                    workers * min(size, self.relay_bucket_bytes) / rate,
                )
            n = config.param_server.relay_deltas
            if n <= 1:
                return whole
            # A delta is encoded from the whole version: after the push.
            delta = size / self.delta_encode_bytes_per_s + chain(size * self.delta_ratio)
            return ((n - 1) * delta + whole) / n
        replicas = max(1, config.param_server.replicas)
        return size * max(1 / self.pull_bytes_per_s, workers / (replicas * self.server_bytes_per_s))


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A program's roofline seconds per call, by name (``trainer.accumulate``, ...)."""

    seconds: Mapping[str, float]

    def __getitem__(self, name: str) -> float:
        if name not in self.seconds:
            raise KeyError(
                f"the AOT reports have no program {name!r} (they have: "
                f"{', '.join(sorted(self.seconds))}); compile the trainer and the inference "
                "programs of this config"
            )
        return self.seconds[name]

    def get(self, name: str) -> float:
        return self.seconds.get(name, 0.0)


@dataclasses.dataclass(frozen=True)
class PlanCosts:
    """The pieces, in seconds, with what they were made of (``detail``, for the report)."""

    train_s: float  # one update: π_old, the update, the publish cast and the push
    group_s: float  # one group's slots on a worker
    slots: int  # groups a worker runs at once
    reload_s: float  # one worker loading a version
    check_s: float  # a sample's verification on one sandbox
    verifier_slots: int  # sandboxes verifying at once (verifier_slots_of)
    version_bytes: int
    detail: dict[str, float]
    # True: a worker's step costs the same for fewer groups (the engine's fixed-shape decode
    # program, on every backend), so k < slots groups take group_s; False: k groups take
    # k/slots of it (a model of an engine whose steps cost what their rows do).
    batched: bool = True
    eval_s: float = 0.0  # one held-out evaluation's generation on the workers (with_eval)
    eval_verify_s: float = 0.0  # and its verification after it
    # > 0: the workers and the verifier's sandboxes share this many cores (the CPU stand-in,
    # one machine), and an update cannot take less than the seconds it asks of them over this
    # (``predict.core_seconds``); 0: each has its own chips or machines.
    shared_cores: float = 0.0
    group_core_s: float = 0.0  # a group's seconds of those cores: group_s without the sharing
    env_reply_s: float = 0.0  # an environment's reply to one turn (multi-turn episodes), given


def version_bytes(config: RunConfig) -> int:
    """Bytes of a published version: the weights in trainer.publish_dtype, or with LoRA the
    adapters alone in float32 (``Trainer.publish``)."""
    m = config.model
    if m.lora_rank:
        return 4 * m.adapter_count()
    itemsize = 2 if config.trainer.publish_dtype == "bfloat16" else 4
    return itemsize * m.param_count()


def verifier_slots(config: RunConfig) -> int:
    """Sandboxes verifying at once: every verifier replica's."""
    return config.verifiers.workers * config.topology.verifier_replicas


def step_verify_s(costs: PlanCosts, samples: int) -> float:
    """Seconds to verify ``samples`` generated together: ⌈samples / slots⌉ rounds of check_s
    (one round with unbounded sandboxes, verifier_slots 0)."""
    rounds = math.ceil(samples / costs.verifier_slots) if costs.verifier_slots else 1
    return rounds * costs.check_s


def share_time(k: int, slots: int, lengths: GroupLengths | None = None, seed: int = 0) -> float:
    """A worker's time for k groups started together, in mean groups' times, with fixed-shape
    decode steps (a step costs the same however few rows are busy): ⌈k / slots⌉ waves, the full
    ones at the mean (continuous batching refills slots as groups end) and the last ending with
    its slowest group, the expected longest latency of min(k, slots) groups drawn from
    ``lengths`` (None: every group the mean, so ⌈k / slots⌉)."""
    if k <= 0:
        return 0.0
    held = min(k, slots)
    slowest = lengths.expected_max_latency(held, seed=seed) if lengths is not None else 1.0
    return math.ceil(k / slots) - 1 + slowest


def with_eval(
    config: RunConfig, costs: PlanCosts, workers: int, lengths: GroupLengths | None = None
) -> PlanCosts:
    """``costs`` with the held-out evaluation's seconds on ``workers`` workers (module
    docstring; 0 when data.eval_every is 0). With fixed-shape steps (``batched``) the last
    wave ends with its slowest group, drawn from ``lengths`` (None: every group the mean)."""
    d = config.data
    if d.eval_every <= 0:
        return dataclasses.replace(costs, eval_s=0.0, eval_verify_s=0.0)
    samples = d.eval_problems * d.eval_samples
    groups = samples / config.algorithm.group_size
    if costs.batched:  # the worker with the most groups ends it (share_time)
        k = math.ceil(groups / workers)
        waves = share_time(k, costs.slots, lengths, config.controller.seed)
    else:
        waves = groups / (workers * costs.slots)
    return dataclasses.replace(
        costs, eval_s=waves * costs.group_s, eval_verify_s=step_verify_s(costs, samples)
    )


def env_wait_s(config: RunConfig, reply_s: float, episodes: int) -> float:
    """Seconds a job of ``episodes`` multi-turn episodes waits on environment replies beyond
    its turns' generation (0 without an environment). Every model turn gets a reply (the last
    one grades it); at most ``environment.concurrency`` replies run at once. Lock-step: each
    of the T = ``max_turns`` turns waits for all of the job's replies, T rounds of
    ⌈episodes / concurrency⌉. One by one: an episode's reply overlaps the other episodes'
    turns, so a job waits on the replies of its last turns only: T rounds when it is a single
    group's episodes (nothing of the job overlaps them), else the rounds of one turn. At mean
    lengths this leaves out what one by one gains when turns' lengths vary (no turn waits
    for the slowest of its round)."""
    env = config.environment
    if env.name == "none" or reply_s <= 0 or episodes <= 0:
        return 0.0
    rounds = math.ceil(episodes / env.concurrency)
    if env.schedule == "lockstep" or episodes <= config.algorithm.group_size:
        return env.max_turns * rounds * reply_s
    return rounds * reply_s


def worker_slots(config: RunConfig, workload: Workload, backend: str = "tpu") -> int:
    """Groups one worker holds at once: its decode rows, or its KV pages, whichever binds."""
    icfg, g = config.inference, config.algorithm.group_size
    pages = icfg.kv_cache_bytes // page_bytes(config.model, icfg.page_size, backend)
    # The prompt's pages are shared by the group; each sample has its completion's own.
    per_group = math.ceil(workload.prompt / icfg.page_size) + g * math.ceil(
        workload.completion / icfg.page_size
    )
    return max(1, min(icfg.max_concurrent_seqs // g, pages // per_group))


def plan_costs(
    config: RunConfig,
    roofline: Roofline,
    *,
    workload: Workload,
    efficiency: Efficiency,
    network: Network,
    workers: int,
    compiled_rows: int,
    compiled_columns: int,
    check_s: float,
) -> PlanCosts:
    """The costs of ``config`` on the layout whose programs ``roofline`` times, with
    ``workers`` inference workers (module docstring). ``compiled_rows`` x ``compiled_columns``:
    the trainer's compiled micro-batch (``trainer.aot.micro_batch_shape``)."""
    icfg, g = config.inference, config.algorithm.group_size
    rollouts = config.rollouts_per_step
    micro = math.ceil(rollouts / compiled_rows)
    fill = min(1.0, (workload.prompt + workload.completion) / compiled_columns)
    if any(name.startswith("trainer.replay") for name in roofline.seconds):
        raise ValueError(
            "the planner does not model π_old replayed token by token (trainer.old_logprobs = "
            "'replay') yet; plan with trainer.old_logprobs = 'prefill'"
        )
    # Whichever π_old / π_ref / value scorings the config turns on, once per micro-batch.
    per_micro = roofline["trainer.accumulate"] + sum(
        roofline.get(f"trainer.{name}")
        for name in ("prefill_old", "score_old", "score_ref", "values")
    )
    update = (
        roofline.get("trainer.prepare")
        + micro * fill * per_micro
        + roofline["trainer.apply"]
        + roofline.get("trainer.publish")
    ) / efficiency.train
    size = version_bytes(config)
    push = size / network.server_bytes_per_s
    if icfg.prefill_rows > 0:
        calls = workload.prompt / (icfg.prefill_rows * icfg.prefill_len)
        prefill = calls * roofline["inference.prefill"] / efficiency.prefill
        steps = workload.completion
    else:  # prompts run as decode rows, prefill_chunk tokens of one a step
        prefill = 0.0
        steps = workload.completion + workload.prompt / icfg.prefill_chunk
    decode_step = roofline["inference.decode"] / efficiency.decode
    slots = worker_slots(config, workload)
    reload = network.reload_s(config, size, workers)
    overlap = config.trainer.publish_in_flight > 0 and config.controller.mode == "throughput"
    return PlanCosts(
        train_s=max(update, push) if overlap else update + push,  # overlap: beside the next
        # Each prefill call stalls every slot's decode: a group sees its own and, in the steady
        # state, those of the slots - 1 others that start while it runs.
        group_s=slots * prefill + steps * decode_step,
        slots=slots,
        reload_s=reload,
        check_s=check_s,
        verifier_slots=verifier_slots(config),
        version_bytes=size,
        detail={
            "micro_batches": float(micro),
            "micro_batch_fill": fill,
            "update_s": update,
            "push_s": push,
            "prefill_s": prefill,
            "decode_step_s": decode_step,
            "group_samples": float(g),
        },
    )
