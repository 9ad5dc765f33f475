"""Typed run configuration: one frozen, keyword-only dataclass per component.

Config files (``configs/*.py``) build an ``ml_collections.ConfigDict`` from :func:`base_config_dict`,
edit it, and the command line may override fields (``--config.trainer.learning_rate=3e-6``). The
result is turned into a :class:`RunConfig` by :func:`from_dict`, which rejects unknown keys, wrong
types, out-of-range values and inconsistent combinations. Every error names the dotted field path and
says why, e.g. ``trainer.learning_rate = -1.0: must be > 0``.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import importlib
import ipaddress
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import ml_collections

# Acceptance staleness meaning "no bound" (η_a = ∞, RLAX's fully off-policy mode).
UNBOUNDED = -1

ALGORITHMS = (
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "cispo",
    "reinforce",
    "rloo",
    "reinforce_pp",
    "ppo",
    "aipo",
    "tb",
    "online_dpo",
    "sapo",
    "luspo",
    "vespo",
)
# Algorithms whose advantage or loss is defined over a group of samples of one prompt.
GROUP_ALGORITHMS = frozenset(
    {
        "grpo",
        "dapo",
        "dr_grpo",
        "gspo",
        "cispo",
        "rloo",
        "tb",
        "online_dpo",
        "sapo",
        "luspo",
        "vespo",
    }
)
LANGUAGES = ("python", "cpp", "rust", "java")
# Algorithms user code registered (rlax_tpu.algorithms.register_algorithm): name -> whether it is
# defined over a group. A config names the modules that register them in algorithm.plugins.
_REGISTERED_ALGORITHMS: dict[str, bool] = {}


def register_algorithm_name(name: str, *, group: bool) -> None:
    """Makes ``name`` a valid algorithm.name (called by algorithms.register_algorithm)."""
    if name in ALGORITHMS:
        raise ValueError(f"{name!r} is a built-in algorithm; register another name")
    _REGISTERED_ALGORITHMS[name] = group


def known_algorithms() -> tuple[str, ...]:
    return (*ALGORITHMS, *_REGISTERED_ALGORITHMS)


REWARDS = ("verdict", "partial")
_REGISTERED_REWARDS: list[str] = []


def register_reward_name(name: str) -> None:
    """Makes ``name`` a valid algorithm.reward (called by algorithms.register_reward)."""
    if name in REWARDS:
        raise ValueError(f"{name!r} is a built-in reward function; register another name")
    _REGISTERED_REWARDS.append(name)


def known_rewards() -> tuple[str, ...]:
    return (*REWARDS, *_REGISTERED_REWARDS)


_NO_VALUE = object()


class ConfigError(ValueError):
    """A bad config value: ``<field> = <value>: <why>``, with ``field`` the dotted path."""

    def __init__(self, field: str, why: str, value: Any = _NO_VALUE):
        self.field, self.why, self.value = field, why, value
        shown = "" if value is _NO_VALUE else f" = {value!r}"
        super().__init__(f"{field}{shown}: {why}" if field else why)

    def prefixed(self, prefix: str) -> ConfigError:
        field = f"{prefix}.{self.field}" if self.field else prefix
        return ConfigError(field, self.why, self.value)


# ---------------------------------------------------------------------------------------------
# Small validation helpers used by the dataclasses' __post_init__.


def _bad(obj: Any, name: str, why: str) -> ConfigError:
    return ConfigError(name, why, getattr(obj, name))


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        if not getattr(obj, n) > 0:
            raise _bad(obj, n, "must be > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 0:
            raise _bad(obj, n, "must be >= 0")


def _in_range(obj: Any, name: str, lo: float, hi: float, *, hi_open: bool = False) -> None:
    v = getattr(obj, name)
    if not (lo <= v < hi if hi_open else lo <= v <= hi):
        raise _bad(obj, name, f"must be in [{lo}, {hi}{')' if hi_open else ']'}")


def _check_address(obj: Any, name: str, auth_token_file: str, tls_cert_file: str) -> None:
    """A service binds to loopback unless credentials are configured (no open doors)."""
    addr = getattr(obj, name)
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise _bad(obj, name, "must be 'host:port' (port 0 picks a free port)")
    if int(port) > 65535:
        raise _bad(obj, name, "port must be <= 65535")
    # TLS alone (server certificate) does not authenticate clients, so it is not enough.
    del tls_cert_file
    if not _is_loopback(host) and not auth_token_file:
        raise _bad(
            obj,
            name,
            "a non-loopback address needs credentials: set auth_token_file "
            "(TLS alone does not authenticate clients)",
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def detect_accelerator() -> Literal["tpu", "gpu", "cpu"]:
    """The accelerator this host has, from device nodes (cheap: does not start JAX)."""
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    return "cpu"


_frozen = dataclasses.dataclass(frozen=True, kw_only=True)


# ---------------------------------------------------------------------------------------------
# Component configs.


@_frozen
class ModelConfig:
    """Decoder-only transformer (Llama / Qwen2 / Qwen3 families)."""

    # Family: tensor names, biases and norms follow it.
    arch: Literal["llama", "qwen2", "qwen3"] = "llama"
    vocab_size: int = 512  # tokens in the vocabulary (embedding rows)
    hidden_size: int = 128  # model width
    intermediate_size: int = 384  # MLP hidden width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 0  # per-head width; 0: hidden_size // num_heads
    rope_theta: float = 10_000.0  # RoPE frequency base
    # "dynamic" (NTK) picks its base from the longest position of each call, so past
    # max_position_embeddings cached decoding and the full forward disagree (models/rope.py).
    # RoPE context scaling.
    rope_scaling: Literal["none", "linear", "dynamic", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = 1.0  # context extension factor of rope_scaling
    # Context length the model was pretrained with, for llama3 / yarn scaling; 0: max_position_embeddings.
    rope_original_max_position_embeddings: int = 0
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low-frequency wavelength factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high-frequency wavelength factor
    rope_beta_fast: float = 32.0  # yarn: rotations where interpolation starts
    rope_beta_slow: float = 1.0  # yarn: rotations where interpolation is full
    rope_attention_factor: float = 0.0  # yarn cos/sin scale; 0: 0.1 * ln(factor) + 1
    max_position_embeddings: int = 2048  # longest sequence (prompt + generation) the model takes
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    qkv_bias: bool = False  # qwen2: q, k, v biases; llama / qwen3 (HF attention_bias): q, k, v, o
    qk_norm: bool = False  # RMSNorm on queries and keys per head (qwen3)
    tie_embeddings: bool = True  # the output projection is the embedding matrix
    # Storage dtype: the weights as loaded or initialized, as inference workers hold them and as
    # the trainer's frozen reference copy keeps them. The trainer's own copy is trainer.master_dtype.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Compute dtype: activations and matmul inputs; weights are cast to it where used (bf16 on TPU).
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # Where the initial weights come from: random init (seeded), HF safetensors dir, or a GGUF file.
    weights_format: Literal["init", "safetensors", "gguf"] = "init"
    weights_path: str = ""  # the safetensors directory or GGUF file of weights_format
    tokenizer_path: str = ""  # "" means: the tokenizer that comes with the weights / the task
    seed: int = 0  # seed of the random init (weights_format "init")

    def __post_init__(self) -> None:
        _positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "rope_theta",
            "max_position_embeddings",
            "rms_norm_eps",
        )
        _non_negative(self, "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise _bad(
                self,
                "num_kv_heads",
                f"must divide num_heads ({self.num_heads}) for grouped-query attention",
            )
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise _bad(
                self,
                "hidden_size",
                f"must be divisible by num_heads ({self.num_heads}) when head_dim is 0",
            )
        if self.rope_scaling_factor < 1.0:
            raise _bad(self, "rope_scaling_factor", "must be >= 1")
        if self.rope_scaling == "none" and self.rope_scaling_factor != 1.0:
            raise _bad(self, "rope_scaling_factor", "is set but rope_scaling is 'none'")
        _non_negative(self, "rope_original_max_position_embeddings", "rope_attention_factor")
        if self.rope_scaling == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise _bad(
                self,
                "rope_high_freq_factor",
                f"must be > rope_low_freq_factor ({self.rope_low_freq_factor}) > 0 for llama3 RoPE",
            )
        if self.rope_scaling == "yarn" and not 0 < self.rope_beta_slow < self.rope_beta_fast:
            raise _bad(
                self,
                "rope_beta_fast",
                f"must be > rope_beta_slow ({self.rope_beta_slow}) > 0 for yarn RoPE",
            )
        if self.weights_format != "init" and not self.weights_path:
            raise _bad(
                self, "weights_path", f"required when weights_format is '{self.weights_format}'"
            )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def resolved_rope_original_max_position_embeddings(self) -> int:
        return self.rope_original_max_position_embeddings or self.max_position_embeddings


@_frozen
class MeshConfig:
    """Device mesh axes. One axis may be -1: it takes the devices the others leave."""

    data: int = 1  # data-parallel axis (batch rows)
    fsdp: int = -1  # fully sharded axis (parameters and batch)
    tensor: int = 1  # tensor-parallel axis (heads, MLP width)

    def __post_init__(self) -> None:
        for n in ("data", "fsdp", "tensor"):
            if getattr(self, n) == 0 or getattr(self, n) < -1:
                raise _bad(self, n, "must be >= 1, or -1 for 'the remaining devices'")
        if sum(getattr(self, n) == -1 for n in ("data", "fsdp", "tensor")) > 1:
            raise ConfigError("", "at most one of data, fsdp, tensor may be -1")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) for ``num_devices`` devices; raises ConfigError if they don't fit."""
        sizes = [self.data, self.fsdp, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ConfigError(
                    "mesh",
                    f"{num_devices} devices are not divisible by the fixed axes' product {known}",
                )
            sizes[sizes.index(-1)] = num_devices // known
        elif known != num_devices:
            raise ConfigError("mesh", f"data*fsdp*tensor = {known} but {num_devices} devices exist")
        return tuple(sizes)  # type: ignore[return-value]


@_frozen
class DistributedConfig:
    """How a component spanning several hosts joins its ``jax.distributed`` job.

    ``coordinator_address`` "": one process, nothing is started. "auto": jax.distributed finds
    everything in the environment (TPU VM metadata, a GKE JobSet's variables). "host:port":
    process 0 runs the coordinator there and every process names its own ``process_id``. JAX's
    coordinator has no credentials: keep it on the job's private network.
    """

    coordinator_address: str = ""  # "" one process; "auto"; or "host:port" of process 0
    num_processes: int = 1  # processes in the job (one per host)
    process_id: int = 0  # this process's index, with a host:port coordinator
    initialization_timeout_s: int = 300  # how long processes wait for each other to join

    def __post_init__(self) -> None:
        _positive(self, "num_processes", "initialization_timeout_s")
        if self.coordinator_address not in ("", "auto"):
            host, sep, port = self.coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise _bad(self, "coordinator_address", "must be '', 'auto' or 'host:port'")
            if not 0 <= self.process_id < self.num_processes:
                raise _bad(
                    self, "process_id", f"must be in [0, num_processes={self.num_processes})"
                )
        elif self.coordinator_address == "" and self.num_processes != 1:
            raise _bad(self, "num_processes", "needs a coordinator_address ('auto' or 'host:port')")

    @property
    def enabled(self) -> bool:
        return self.coordinator_address != ""


@_frozen
class TrainerConfig:
    learning_rate: float = 1e-6  # AdamW peak learning rate
    # Learning-rate schedule over controller.num_steps.
    schedule: Literal["constant", "warmup_cosine", "warmup_stable_decay"] = "constant"
    warmup_steps: int = 0  # linear warm-up updates of the schedule
    decay_steps: int = 0  # for warmup_stable_decay: length of the final decay
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_b1: float = 0.9  # AdamW beta1
    adam_b2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip_norm: float = 1.0  # global gradient-norm clip; 0 disables clipping
    micro_batch_size: int = 8  # rollouts per micro-batch (gradient accumulation)
    length_bucket: int = 16  # micro-batch lengths are padded to a multiple (bounds recompiles)
    # Compile the update for every micro-batch shape the inference limits allow during the first
    # step, so later steps never stall on a compile (costs one compile per shape up front).
    precompile: bool = False
    remat: bool = True  # each layer of the training forward under jax.checkpoint(remat_policy)
    # "nothing_saveable" keeps only layer inputs, so the forward fuses as at inference (RLAX §5).
    remat_policy: Literal[
        "nothing_saveable",
        "dots_saveable",
        "dots_with_no_batch_dims_saveable",
        "everything_saveable",
    ] = "nothing_saveable"
    # The trainer's forwards as one lax.scan over stacked layer parameters: one compiled layer
    # body whatever the depth (compile time and program size stay flat), at the price of one
    # copy of the layer parameters per call. Off: layers unrolled.
    scan_layers: bool = False
    # The training forward's attention: "splash" (JAX's TPU splash kernel: memory linear in the
    # sequence), "dense" (materializes [L, L] scores; the CPU reference), "auto" (splash on TPU).
    attention: Literal["auto", "dense", "splash"] = "auto"
    align_logprobs: bool = True  # recompute π_old with the inference graph (DESIGN §6)
    # How the aligned π_old is recomputed. "replay": token by token through the engine's own
    # programs at its shapes (bitwise the sampler's log-probs on CPU; cost grows with the
    # completion length and holds an engine-sized cache). "prefill": one prefill-shaped pass
    # per micro-batch on the trainer's mesh through the engine's paged-attention backend (the
    # ragged kernel on TPU; RLAX §5.1), to round-off. "auto": replay on CPU, prefill elsewhere.
    old_logprobs: Literal["auto", "replay", "prefill"] = "auto"
    # Publish dtype: the weights pushed to the parameter server (what inference workers pull).
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    # Master dtype: the trainer's trainable weights, AdamW moments and gradient accumulator,
    # whatever model.param_dtype is (mixed precision: float32 masters, model.compute_dtype
    # forward and backward). bfloat16 masters are refused when most AdamW steps of about
    # learning_rate would round to nothing (trainer/precision.py).
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    checkpoint_every: int = 1  # save an Orbax checkpoint every N versions
    # At least controller.snapshot_keep / checkpoint_every, so every kept snapshot has its
    # checkpoint (or an older one a resume falls back to).
    keep_checkpoints: int = 3
    checkpoint_dir: str = ""  # "" means <controller.run_dir>/trainer
    # Non-finite loss/grads: 'skip' drops the update, 'stop' halts.
    nan_policy: Literal["skip", "stop"] = "stop"
    # A trainer spanning several hosts (its mesh over all their devices): process 0 serves, the
    # others follow its calls (trainer/lockstep.py).
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    address: str = "127.0.0.1:0"  # gRPC address the trainer serves on (distributed transport)
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain

    def __post_init__(self) -> None:
        _positive(self, "learning_rate", "micro_batch_size", "checkpoint_every", "keep_checkpoints")
        _positive(self, "length_bucket")
        _non_negative(self, "warmup_steps", "decay_steps", "weight_decay", "grad_clip_norm")
        _positive(self, "adam_eps")
        _in_range(self, "adam_b1", 0.0, 1.0, hi_open=True)
        _in_range(self, "adam_b2", 0.0, 1.0, hi_open=True)
        if self.schedule == "warmup_stable_decay" and self.decay_steps == 0:
            raise _bad(self, "decay_steps", "must be > 0 for the warmup_stable_decay schedule")
        _check_address(self, "address", self.auth_token_file, self.tls_cert_file)


def _one_device() -> MeshConfig:
    return MeshConfig(data=1, fsdp=1, tensor=1)


@_frozen
class InferenceConfig:
    num_workers: int = 1  # inference workers (engines), each on its own devices
    # "tpu_emulated": the TPU cache layout and packing with an XLA stand-in for the kernel (tests
    # of the TPU path on CPU; see models/paged_attention.py).
    backend: Literal["auto", "cpu", "gpu", "tpu", "tpu_emulated"] = "auto"
    # Each worker's device mesh (the first data*fsdp*tensor devices it sees; -1: all of them):
    # weights and KV pages split over heads on tensor, decode rows over data. Default one device.
    mesh: MeshConfig = dataclasses.field(default_factory=_one_device)
    # A worker spanning several hosts (its mesh over all their devices): process 0 serves, the
    # others follow its engine steps.
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    # The parameter-server replica this worker pulls from (controller.param_server_endpoints[r]).
    # -1: worker i of the local transport reads replica i mod replicas; a standalone worker then
    # needs it set when there are several replicas.
    param_server_replica: int = -1
    # This worker's index among num_workers, for a worker started on its own (a cluster pod):
    # with param_server_replica -1 it reads replica worker_index mod replicas. -1: not given.
    worker_index: int = -1
    max_concurrent_seqs: int = 64  # sequences an engine runs at once (continuous batching)
    page_size: int = 16  # tokens per KV page
    kv_cache_bytes: int = 256 * 2**20  # memory budget for KV pages, per worker
    # The prefill program's fixed shape: prefill_rows prompt chunks of prefill_len tokens per call
    # (keys/values only; the replay cuts prompts the same way). 0 rows: prompts run as decode rows.
    prefill_rows: int = 4
    prefill_len: int = 16  # tokens per prefill chunk
    prefill_chunk: int = 128  # decode rows one sequence may take per step (recompute)
    # Token rows per decode step (one token per row); 0 means max_concurrent_seqs. Fixed, so
    # steps never recompile and logits do not depend on batching.
    step_tokens: int = 0
    # CPU backend only (the TPU/GPU kernels already stop at each row's length). >= 2: a decode
    # step sorts its rows by position into span_groups equal groups, and each group attends over
    # its longest row's pages, rounded up to a multiple of span_bucket_pages, instead of the whole
    # cache (each distinct grouping is one more compiled program, see Engine.precompile). Faster
    # when lengths vary, but XLA:CPU then rounds a token's f32 log-prob differently with the
    # group it falls in (~1e-7): log-probs are no longer bitwise the dense-cache replay, so it
    # needs trainer.align_logprobs = False. 0: off, every row attends over the whole cache.
    span_groups: int = 0
    span_bucket_pages: int = 4  # span_groups: attention spans round up to this many pages
    # CPU backend: a decode step attends over the pages block by block (this many pages each,
    # online softmax) up to its furthest row's position, not over the whole cache; a token's
    # bits still depend on its own row alone, so replays stay bitwise. 0: the whole cache.
    attention_block_pages: int = 4
    # CPU backend, decode rows, one device: 'native' attends with a C++ kernel built on first
    # use (reads pages in place, writes the new key/value in place; bits still per row) and
    # takes the sampler's per-row max / log-normalizer / argmax from another, 'xla' with XLA's
    # block attention above and XLA's reductions, 'auto' native where a C++ compiler is found.
    attention_kernel: str = "auto"
    max_prompt_len: int = 256  # longer prompts are skipped when drawn (counted)
    max_new_tokens: int = 256  # generation budget per sample
    temperature: float = 1.0  # sampling temperature (behaviour log-probs are under it)
    top_k: int = 0  # sample from the k likeliest tokens; 0: off
    top_p: float = 1.0  # nucleus sampling mass; 1: off
    # Partial rollouts (throughput mode): a worker reloads as soon as a job of a newer version
    # arrives, and in-flight requests continue under the new weights (per-token versions
    # recorded; staleness counts the oldest token) instead of waiting for them to finish.
    continue_on_reload: bool = False
    address: str = "127.0.0.1:0"  # gRPC address a worker serves on (distributed transport)
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain

    def __post_init__(self) -> None:
        _positive(
            self,
            "num_workers",
            "max_concurrent_seqs",
            "page_size",
            "kv_cache_bytes",
            "prefill_chunk",
            "prefill_len",
            "max_prompt_len",
            "max_new_tokens",
            "temperature",
        )
        _non_negative(
            self, "top_k", "step_tokens", "prefill_rows", "span_groups", "attention_block_pages"
        )
        _positive(self, "span_bucket_pages")
        if self.attention_kernel not in ("auto", "native", "xla"):
            raise _bad(self, "attention_kernel", "must be 'auto', 'native' or 'xla'")
        if self.param_server_replica < -1:
            raise _bad(self, "param_server_replica", "must be >= 0, or -1 for automatic")
        if not -1 <= self.worker_index < self.num_workers:
            raise _bad(
                self, "worker_index", f"must be in [0, num_workers={self.num_workers}), or -1"
            )
        if self.span_groups > self.max_concurrent_seqs:
            raise _bad(
                self, "span_groups", f"must be <= max_concurrent_seqs ({self.max_concurrent_seqs})"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise _bad(self, "top_p", "must be in (0, 1]")
        if self.step_tokens and self.step_tokens < self.max_concurrent_seqs:
            raise _bad(
                self,
                "step_tokens",
                f"must be 0 or >= max_concurrent_seqs ({self.max_concurrent_seqs}): every running "
                "sequence decodes one token per step",
            )
        _check_address(self, "address", self.auth_token_file, self.tls_cert_file)


@_frozen
class ParamServerConfig:
    address: str = "127.0.0.1:0"  # gRPC address the parameter server serves on
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain
    # A second token that publishing (Publish, ReportProgress) needs besides auth_token_file:
    # given to the trainer only, so a worker that may pull weights cannot write them. "": none.
    publish_token_file: str = ""
    in_memory_versions: int = 4  # K: versions kept hot in memory (older ones garbage-collected)
    persist_every: int = 1  # write every N-th version through to persistent storage; 0: never
    persist_path: str = ""  # local dir or gs:// path; "" means <run_dir>/param_server
    # Newest complete persisted versions kept; older ones are deleted after each persist. 0: all.
    persist_keep: int = 3
    chunk_bytes: int = 4 * 2**20  # weights stream in messages of this size
    max_message_bytes: int = 64 * 2**20  # largest gRPC message accepted
    replicas: int = 1  # parameter-server replicas; the trainer publishes to all
    replica_index: int = 0  # which of the replicas this server is; its commits are its progress
    lease_ttl_s: float = 600.0  # a consumer's lease lapses unless renewed within this

    def __post_init__(self) -> None:
        _positive(self, "chunk_bytes", "max_message_bytes", "replicas", "lease_ttl_s")
        _non_negative(self, "persist_every", "persist_keep")
        if not 0 <= self.replica_index < self.replicas:
            raise _bad(self, "replica_index", f"must be in [0, replicas={self.replicas})")
        if self.in_memory_versions < 2:
            raise _bad(
                self,
                "in_memory_versions",
                "must be >= 2 (a new version is written while the previous is read)",
            )
        if self.chunk_bytes > self.max_message_bytes:
            raise _bad(
                self, "chunk_bytes", f"must be <= max_message_bytes ({self.max_message_bytes})"
            )
        _check_address(self, "address", self.auth_token_file, self.tls_cert_file)


@_frozen
class VerifierConfig:
    address: str = "127.0.0.1:0"  # gRPC address the verifier service serves on
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain
    languages: tuple[str, ...] = LANGUAGES  # languages it compiles and runs
    workers: int = 2  # sandboxes running at once
    max_pending: int = 1024  # backpressure: requests queued beyond this are refused
    time_limit_s: float = 2.0  # default per test when the problem gives none
    memory_limit_mb: int = 256  # default memory per program when the problem gives none
    compile_time_limit_s: float = 30.0  # time limit of one compilation
    max_output_bytes: int = 1 << 20  # a program's output beyond this is an output-limit verdict
    # Worker slot i runs untrusted code as uid sandbox_uid + i (RLIMIT_NPROC counts per uid and
    # does not bind root, so each slot gets its own non-root uid). A dedicated range far from
    # system users and `nobody` (65534), whose processes would share the RLIMIT_NPROC budget.
    sandbox_uid: int = 200_000
    testlib_path: str = ""  # testlib.h for problems' own checkers; "" = none available
    request_deadline_s: float = 120.0  # a verify call's default deadline
    compile_memory_limit_mb: int = 2048  # compilers (rustc, javac) need far more than programs
    # Python's syntax check: in a long-lived unprivileged helper process ("helper": compile() runs
    # no code) or one sandbox run per program ("sandbox", ~17 ms each).
    python_check: Literal["helper", "sandbox"] = "helper"
    disk_limit_mb: int = 64  # size of each sandbox's private /work and /tmp (tmpfs, in RAM)
    seccomp: bool = True  # deny kernel attack surface (ptrace, mount, namespaces...) on x86_64
    # Bound each run's memory (all its processes) with a memory cgroup where the host allows
    # it; elsewhere, or False, a run is judged by its peak RSS (docs/configuration.md: Verifier sandbox).
    memory_cgroups: bool = True
    repository_dir: str = ""  # content-addressed test data; "" = a private temporary directory
    # Limits a request may ask for (per test / per unit-test program); larger ones are clamped.
    max_time_limit_s: float = 20.0
    max_memory_limit_mb: int = 1024  # largest memory limit a request may ask for

    def __post_init__(self) -> None:
        _positive(
            self,
            "workers",
            "max_pending",
            "time_limit_s",
            "memory_limit_mb",
            "compile_time_limit_s",
            "max_output_bytes",
            "request_deadline_s",
            "compile_memory_limit_mb",
            "disk_limit_mb",
            "max_time_limit_s",
            "max_memory_limit_mb",
        )
        if not math.isfinite(self.max_time_limit_s) or self.max_time_limit_s < self.time_limit_s:
            raise _bad(
                self,
                "max_time_limit_s",
                f"must be finite and >= time_limit_s ({self.time_limit_s})",
            )
        if self.max_memory_limit_mb < self.memory_limit_mb:
            raise _bad(
                self, "max_memory_limit_mb", f"must be >= memory_limit_mb ({self.memory_limit_mb})"
            )
        if not self.languages:
            raise _bad(self, "languages", "must name at least one language")
        for lang in self.languages:
            if lang not in LANGUAGES:
                raise _bad(
                    self,
                    "languages",
                    f"unknown language {lang!r}; supported: {', '.join(LANGUAGES)}",
                )
        if self.sandbox_uid == 0:
            raise _bad(self, "sandbox_uid", "must not be 0: untrusted code never runs as root")
        if not 0 < self.sandbox_uid <= 2**31 - 1 - self.workers:
            raise _bad(
                self,
                "sandbox_uid",
                "must be > 0 and leave room for one uid per worker (sandbox_uid + workers < 2^31)",
            )
        if self.sandbox_uid < 1000:
            raise _bad(self, "sandbox_uid", "must be >= 1000 (below are system users and daemons)")
        if self.sandbox_uid <= 65535 and self.sandbox_uid + self.workers > 65534:
            raise _bad(
                self,
                "sandbox_uid",
                f"uids {self.sandbox_uid}..{self.sandbox_uid + self.workers - 1} (one per worker) "
                "must not include 65534 (nobody) or 65535 (-1 as a 16-bit uid)",
            )
        _check_address(self, "address", self.auth_token_file, self.tls_cert_file)


@_frozen
class DataConfig:
    # Training datasets (docs/configuration.md, Datasets).
    datasets: tuple[str, ...] = ("procedural",)
    weights: tuple[float, ...] = (1.0,)  # mixture weight of each dataset
    data_dir: str = ""  # local files for file-backed datasets
    train_until_year: int = (  # codeforces: train up to this year, hold out the next
        2024  # codeforces: train up to this year, test on the next (code_contests: its own split)
    )
    # 'chat' (the model's template), 'raw' text, 'auto': chat if it has one.
    prompt_style: Literal["auto", "raw", "chat"] = (
        "auto"  # auto: chat if the tokenizer has a template
    )
    language: str = "python"  # the language the model is asked to write
    eval_every: int = 0  # steps between held-out evaluations; 0: only at start and end
    eval_samples: int = 8  # samples per held-out problem: k of pass@k
    eval_problems: int = 32  # held-out problems per evaluation
    replay: bool = False  # TBA replay: updates draw their groups from a replay buffer
    replay_recency_prob: float = 0.5  # m: draw from the last replay_recent_versions with prob. m
    replay_recent_versions: int = 4  # 'recent' means generated by the last this many versions
    # The non-recent draw: softmax of reward, or uniform.
    replay_priority: Literal["reward", "uniform"] = "reward"
    replay_temperature: float = 1.0  # temperature of the reward softmax
    replay_per_prompt: int = 16  # rollouts kept per prompt (oldest evicted)
    replay_max_items: int = 100_000  # rollouts kept in all (oldest evicted)
    # Pre-filtering (RLAX §6.2 curation): before a fresh run's first update, every training
    # problem gets prefilter_samples samples from the initial policy, and only problems whose pass
    # rate r has prefilter_low < r < prefilter_high are trained on (partially solved: the others
    # teach a group-relative objective nothing). The result is kept in <run_dir>/prefilter.json.
    # prefilter_problems > 0 measures (and so trains on) only the first that many of each
    # dataset. 0 samples: off.
    prefilter_samples: int = 0
    prefilter_low: float = 0.0  # pass rates <= this are dropped (never solved)
    prefilter_high: float = 1.0  # pass rates >= this are dropped (always solved)
    prefilter_problems: int = 0  # measure the first N problems of each dataset; 0: all

    def __post_init__(self) -> None:
        if not self.datasets:
            raise _bad(self, "datasets", "must name at least one dataset")
        if len(self.weights) != len(self.datasets):
            raise _bad(
                self,
                "weights",
                f"needs one weight per dataset ({len(self.datasets)}), got {len(self.weights)}",
            )
        if any(not w > 0 for w in self.weights):
            raise _bad(self, "weights", "every mixture weight must be > 0")
        _non_negative(self, "eval_every")
        if self.language not in LANGUAGES:
            raise _bad(self, "language", f"must be one of {', '.join(LANGUAGES)}")
        _positive(
            self,
            "eval_samples",
            "eval_problems",
            "replay_recent_versions",
            "replay_temperature",
            "replay_per_prompt",
            "replay_max_items",
        )
        _in_range(self, "replay_recency_prob", 0.0, 1.0)
        _non_negative(self, "prefilter_samples", "prefilter_problems")
        if not 0.0 <= self.prefilter_low < self.prefilter_high <= 1.0:
            raise _bad(
                self,
                "prefilter_low",
                f"need 0 <= prefilter_low < prefilter_high <= 1 "
                f"(prefilter_high = {self.prefilter_high})",
            )


@_frozen
class AlgorithmConfig:
    """The objective (DESIGN §5). Zero/empty values mean "the named algorithm's paper default"."""

    name: str = "grpo"  # the objective: a built-in (docs/configuration.md) or a registered plugin's
    group_size: int = 8  # G samples per prompt
    eps_low: float = 0.0  # PPO-style clip 1 - ε_low; 0 = algorithm default
    eps_high: float = 0.0  # clip 1 + ε_high; 0 = algorithm default
    # Regularizer β·R: 'default' = the algorithm's paper default (grpo: k3 with β 0.04; dapo and
    # most others: off), 'none' turns it off; with an estimator, kl_coef 0 = algorithm default β.
    kl_coef: float = 0.0
    # The KL estimator of kl_coef's regularizer (see above).
    kl_estimator: Literal["default", "none", "k1", "k2", "k3"] = "default"
    # The KL regularizer times the importance ratio ρ = π_θ/π_old (differentiated): an unbiased
    # estimate of KL(π_θ‖π_ref) from π_old's samples (TRL's use_bias_correction_kl).
    kl_bias_correction: bool = False
    # Two-sided clipping (INTELLECT-2; TRL's delta): no gradient where the ratio exceeds delta,
    # whatever the advantage's sign; > 1 (e.g. 4). 0: off. PPO-clipped algorithms only.
    delta: float = 0.0
    # Advantage scaling of group-relative algorithms: "group" (r − mean)/(group std + eps),
    # "batch" (r − group mean)/(batch std + eps) (PPO Lite; TRL's scale_rewards="batch"),
    # "none" r − group mean (Dr.GRPO); "default": the algorithm's own.
    reward_scaling: Literal["default", "group", "batch", "none"] = "default"
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature τ for tokens with A > 0
    sapo_tau_neg: float = 1.05  # SAPO's gate temperature τ for tokens with A <= 0
    # VESPO's Gamma weight φ(w) = e^λ·w^k·e^(−λw) of the sequence ratio w, per advantage sign.
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0  # VESPO's decay λ for A >= 0
    vespo_k_neg: float = 3.0  # VESPO's exponent k for A < 0
    vespo_lambda_neg: float = 2.0  # VESPO's decay λ for A < 0
    reward_kl_coef: float = 0.0  # KL folded into the reward (ppo, reinforce_pp); 0 = default
    # Token weights: per-sequence mean, token mean, or 1/(B·L_max).
    aggregation: Literal["default", "seq_mean_token_mean", "token_mean", "max_length"] = "default"
    is_cap: float = 0.0  # AIPO truncation c; 0 = algorithm default
    # reweight by c = π_old/μ per token or sequence
    behaviour_correction: Literal[
        "none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"
    ] = "none"
    behaviour_cap: float = 2.0  # upper bound on c (truncate or mask)
    # *_mask only: keep c = π_old/μ inside [behaviour_floor, behaviour_cap] (IcePop's two-sided
    # band, e.g. 0.5 and 2); 0 = one-sided. seq_* modes use the length-normalized (geometric) c.
    behaviour_floor: float = 0.0
    # group_norm advantages (r - mean) / (std + group_std_eps): verl's 1e-6; TRL adds 1e-4. It
    # decides how far a group with nearly equal rewards is blown up.
    group_std_eps: float = 1e-6
    # DAPO: drop groups with equal rewards, refill the batch.
    dynamic_sampling: Literal["default", "on", "off"] = "default"
    overlong_shaping: Literal["default", "on", "off"] = "default"  # DAPO soft overlong punishment
    overlong_buffer: int = 0  # its length L_cache; 0 = max_new_tokens // 5 (DAPO's 4096 of 20480)
    overlong_penalty: float = 1.0  # reward at and beyond max_new_tokens
    gamma: float = 1.0  # PPO GAE discount γ
    gae_lambda: float = 0.95  # PPO GAE λ (bias-variance trade-off)
    value_clip: float = 0.2  # PPO value clipping range
    value_coef: float = 0.0  # PPO value-loss weight; 0 = algorithm default
    # TB's β decays linearly from tb_beta to tb_beta_final over tb_beta_decay_steps (0: constant).
    tb_beta: float = 0.012
    tb_beta_final: float = 0.004  # TB's β after the decay
    tb_beta_decay_steps: int = 500  # updates over which β decays; 0: constant
    dpo_beta: float = 0.1  # online DPO's β
    # Python modules imported before algorithm.name is checked, so that they can register
    # algorithms, advantage estimators and reward functions (rlax_tpu.algorithms.
    # register_algorithm / register_advantage / register_reward); every process that builds the
    # objective imports them.
    plugins: tuple[str, ...] = ()
    # The reward of a rollout from its verdict: "verdict" (1 accepted, else 0), "partial" (the
    # fraction of tests passed), or a function registered by a plugin. Evaluation's pass@1
    # counts accepted answers whatever the reward.
    reward: str = "verdict"

    def __post_init__(self) -> None:
        for module in self.plugins:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any failure of user code, named
                raise _bad(
                    self, "plugins", f"cannot import {module!r}: {type(e).__name__}: {e}"
                ) from None
        known = known_algorithms()
        if self.name not in known:
            close = difflib.get_close_matches(self.name, known, n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; built-in: {', '.join(ALGORITHMS)} (an algorithm of your own: name the "
                "module that registers it in algorithm.plugins)"
            )
            raise _bad(self, "name", f"unknown algorithm{hint}")
        if self.reward not in known_rewards():
            raise _bad(
                self,
                "reward",
                f"unknown reward function; built-in: {', '.join(REWARDS)} "
                "(one of your own: name the module that registers it in "
                "algorithm.plugins)",
            )
        _positive(
            self,
            "group_size",
            "behaviour_cap",
            "overlong_penalty",
            "tb_beta",
            "tb_beta_final",
            "dpo_beta",
        )
        _in_range(self, "eps_low", 0.0, 1.0, hi_open=True)
        _non_negative(self, "eps_high", "kl_coef", "is_cap", "overlong_buffer", "value_clip")
        _non_negative(self, "reward_kl_coef", "value_coef", "tb_beta_decay_steps")
        _positive(
            self,
            "group_std_eps",
            "sapo_tau_pos",
            "sapo_tau_neg",
            "vespo_lambda_pos",
            "vespo_lambda_neg",
        )
        _non_negative(self, "vespo_k_pos", "vespo_k_neg", "delta")
        if self.delta and self.delta <= 1.0:
            raise _bad(self, "delta", "caps the ratio from above: must be > 1 (or 0: off)")
        _in_range(self, "gamma", 0.0, 1.0)
        _in_range(self, "gae_lambda", 0.0, 1.0)
        if self.kl_coef > 0 and self.kl_estimator == "none":
            raise _bad(
                self, "kl_estimator", f"is 'none' but kl_coef is {self.kl_coef}; pick k1, k2 or k3"
            )
        grouped = self.name in GROUP_ALGORITHMS or _REGISTERED_ALGORITHMS.get(self.name, False)
        if (grouped or self.name == "aipo") and self.group_size < 2:
            raise _bad(
                self, "group_size", f"{self.name} compares samples within a group: needs >= 2"
            )
        if self.is_cap and self.name != "aipo":
            raise _bad(self, "is_cap", f"only aipo truncates at a cap; {self.name} has none")
        if self.reward_kl_coef and self.name not in ("ppo", "reinforce_pp"):
            raise _bad(
                self, "reward_kl_coef", "only ppo and reinforce_pp fold a KL term into the reward"
            )
        if self.behaviour_correction != "none" and self.name in ("aipo", "tb", "online_dpo"):
            why = {
                "aipo": "aipo's truncated weight min(π/μ, c) already corrects for μ",
                "tb": "tb is off-policy by construction and uses no importance weight",
                "online_dpo": "online_dpo uses no importance weight",
            }[self.name]
            raise _bad(self, "behaviour_correction", f"must be 'none': {why}")
        if self.behaviour_floor and not self.behaviour_correction.endswith("_mask"):
            raise _bad(
                self,
                "behaviour_floor",
                "is the lower edge of a mask band: needs "
                f"behaviour_correction token_mask or seq_mask, not "
                f"{self.behaviour_correction!r}",
            )
        if not 0.0 <= self.behaviour_floor < self.behaviour_cap:
            raise _bad(
                self, "behaviour_floor", f"must be in [0, behaviour_cap = {self.behaviour_cap})"
            )


@_frozen
class ControllerConfig:
    # Where the run's storage lives ("gs://NAME" or a directory): every "{bucket}" in the
    # config's strings (run_dir, weights, data, persistence) is replaced by it when the config
    # is built; a config that names "{bucket}" without it set is refused.
    bucket: str = ""
    run_dir: str = "runs/local"  # snapshots, checkpoints, metrics, report (local or gs://)
    num_steps: int = 20  # updates (versions) the run makes
    prompts_per_step: int = 4  # prompt groups per update (B)
    # Bitwise reproducible steps, or continuous generation.
    mode: Literal["deterministic", "throughput"] = "deterministic"
    reload_staleness: int = 1  # η_r: workers reload every η_r-th version
    acceptance_staleness: int = 1  # η_a: max v − version(rollout); -1 = unbounded
    pipeline_depth: int = 1  # deterministic mode: steps generation runs ahead of training
    # Throughput mode: which ready groups an update takes first.
    consume_order: Literal["oldest_first", "freshest_first"] = "oldest_first"
    # Components in this process, or gRPC services.
    transport: Literal["local", "distributed"] = "local"
    # local transport: the trainer in a spawned child process (its own interpreter and XLA
    # client) instead of this one, so training does not share the GIL with generation.
    trainer_process: bool = False
    # With trainer_process: the CPU cores the child may run on (all its threads; () = any), e.g.
    # to keep it off the cores generation and the sandboxes use, as separate devices would.
    trainer_cpus: tuple[int, ...] = ()
    # distributed transport: endpoints of the components ("host:port").
    inference_endpoints: tuple[str, ...] = ()
    verifier_endpoint: str = ""  # host:port of the verifier service
    trainer_endpoint: str = ""  # host:port of the trainer
    # One per parameter-server replica (replica r at index r); the trainer publishes to all.
    param_server_endpoints: tuple[str, ...] = ()
    auth_token_file: str = ""  # token the controller presents to the components
    # The certificate the components serve with (a PEM holding it; its key is not read here):
    # the controller's channels to them use TLS and trust it. "": plain channels.
    tls_cert_file: str = ""
    rpc_timeout_s: float = 60.0  # per call; a worker unanswering this long is failed over
    # distributed transport: how long the controller waits for a trainer, parameter server,
    # verifier or inference worker that stopped answering to serve again (a restarted pod), then
    # resumes from its newest snapshot; past it the run stops with one line naming the component.
    # 0: stop at once.
    recovery_timeout_s: float = 600.0
    # JAX's persistent compilation cache in <run_dir>/jax_cache (or $JAX_COMPILATION_CACHE_DIR
    # when set: one cache for many runs), shared by the run's processes (controller, trainer,
    # inference workers): a restarted one loads its programs instead of compiling them again.
    compilation_cache: bool = True
    snapshot_keep: int = 3  # newest controller snapshots kept
    # Dynamic sampling (DAPO): while fewer than prompts_per_step groups survive the filter, a
    # step draws more prompts, generated with the step's version, at most this many extra times
    # (throughput mode: admits up to this many batches' worth of filtered groups per update);
    # then it trains on the groups kept. 0: train on what the first round keeps.
    refill_rounds: int = 3
    # Updates in a row with nothing to learn (every group filtered) before the run stops with an
    # error: the data is too hard or too easy for the model, or the verifier is broken. A
    # skipped update changes no weights and no version; its step is drawn afresh.
    max_skipped_updates: int = 10
    log_every: int = 1  # steps between progress lines (metrics are written every step)
    # Supervised warm-up on reference solutions before RL (fresh runs only; 0: none), so a tiny
    # randomly initialized model has some reward signal. The report says when it ran.
    warmup_steps: int = 0
    warmup_batch_size: int = 16  # examples per warm-up step
    warmup_learning_rate: float = 1e-3  # warm-up learning rate
    # Share of warm-up demonstrations that are a problem's known-wrong program instead of its
    # reference (unverified demonstrations): the warmed-up policy then writes the right program
    # only part of the time, and RL from the verifier's reward has to tell them apart.
    warmup_wrong_fraction: float = 0.0
    seed: int = 0  # root of every run-level RNG stream (mixture, sampling, replay)

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise _bad(self, "run_dir", "must be set")
        _positive(
            self,
            "num_steps",
            "prompts_per_step",
            "reload_staleness",
            "rpc_timeout_s",
            "snapshot_keep",
            "log_every",
        )
        _non_negative(
            self,
            "pipeline_depth",
            "warmup_steps",
            "recovery_timeout_s",
            "refill_rounds",
            "max_skipped_updates",
        )
        _positive(self, "warmup_batch_size", "warmup_learning_rate")
        _in_range(self, "warmup_wrong_fraction", 0.0, 1.0, hi_open=True)
        if self.acceptance_staleness < UNBOUNDED:
            raise _bad(self, "acceptance_staleness", "must be >= 0, or -1 for unbounded")
        eta_a, eta_r = self.acceptance_bound, self.reload_staleness
        if eta_a < eta_r - 1:
            raise ConfigError(
                "acceptance_staleness",
                f"can never be met with reload_staleness {eta_r}: "
                f"workers hold a version for {eta_r} updates, so the trainer would need rollouts "
                f"{eta_r - 1} versions old; set acceptance_staleness >= reload_staleness - 1",
                self.acceptance_staleness,
            )
        if self.mode == "deterministic" and self.pipeline_depth + eta_r - 1 > eta_a:
            raise ConfigError(
                "pipeline_depth",
                "in deterministic mode a rollout is consumed up to "
                f"pipeline_depth + reload_staleness - 1 = {self.pipeline_depth + eta_r - 1} versions "
                f"after its weights, more than acceptance_staleness {self.acceptance_staleness}",
                self.pipeline_depth,
            )
        if self.transport == "distributed":
            for n in (
                "verifier_endpoint",
                "trainer_endpoint",
                "param_server_endpoints",
                "inference_endpoints",
            ):
                if not getattr(self, n):
                    raise _bad(self, n, "required when transport is 'distributed'")
            endpoints = [
                *self.inference_endpoints,
                self.verifier_endpoint,
                self.trainer_endpoint,
                *self.param_server_endpoints,
            ]
            remote = [e for e in endpoints if not _is_loopback(e.rpartition(":")[0])]
            if remote and not self.auth_token_file:
                raise ConfigError(
                    "auth_token_file",
                    f"required to reach non-loopback endpoints (e.g. {remote[0]!r})",
                    self.auth_token_file,
                )
        if self.transport == "distributed" and self.trainer_process:
            raise _bad(
                self,
                "trainer_process",
                "applies to the local transport only (the "
                "distributed one reaches the trainer at trainer_endpoint)",
            )
        if self.trainer_cpus and not self.trainer_process:
            raise _bad(self, "trainer_cpus", "needs trainer_process = True")
        if any(c < 0 for c in self.trainer_cpus):
            raise _bad(self, "trainer_cpus", "CPU numbers must be >= 0")
        if self.transport == "distributed" and self.warmup_steps:
            raise _bad(
                self,
                "warmup_steps",
                "needs the local transport (a remote trainer "
                "starts from model.weights_path); set it to 0",
            )

    @property
    def acceptance_bound(self) -> float:
        """η_a as a number (math.inf when unbounded)."""
        return math.inf if self.acceptance_staleness == UNBOUNDED else self.acceptance_staleness


_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_TPU_SLICE = re.compile(r"(v4|v5e|v5p|v6e):\d+(x\d+){1,2}")


@_frozen
class TopologyConfig:
    """Where the components run when the run is deployed (``rlax_tpu.launch``).

    How many of each component there are lives in their own sections (trainer.distributed
    .num_processes, inference.num_workers and inference.distributed.num_processes,
    param_server.replicas); their ports and credentials in their addresses and token files. This
    section adds what only a cluster needs: the slices the trainer and each inference worker run
    on, the pods' image, sizes and restart budget. The local launch and the GKE render read the
    same config, so the two cannot drift.
    """

    name: str = "rlax"  # the JobSet's name, prefix of every object and Service name
    namespace: str = "rlax"  # Kubernetes namespace of every object
    image: str = "rlax-tpu:latest"  # one image for every component (deploy/docker/Containerfile)
    # A TPU slice as "<generation>:<topology>" (the names `python -m rlax_tpu.aot` compiles for),
    # e.g. "v5p:8x8x4"; "" runs the component on CPU nodes.
    trainer_tpu: str = ""
    inference_tpu: str = ""  # each worker's slice
    verifier_replicas: int = 1  # verifier pods behind the verifier Service
    controller_memory_gib: int = 8  # controller pod's memory
    param_server_memory_gib: int = 0  # 0: sized from the model (its hot versions + a quarter)
    # The Kubernetes Secret mounted at the token and certificate files' folder: keys "token",
    # "tls.pem" (a certificate for *.<namespace>.svc with its key) and "publish-token".
    credentials_secret: str = "rlax-credentials"
    # Kubernetes service account of the pods (Workload Identity to the run's bucket).
    service_account: str = "rlax"
    # Restarts of the whole JobSet (a preemption restarts every job; the run resumes from its
    # snapshots) before it is marked failed.
    max_restarts: int = 50
    # One host, local transport (a single TPU VM): the trainer's mesh takes the first
    # trainer_devices devices and inference worker i the i-th group of inference.mesh's size
    # after them, so training and generation run side by side on their own chips. 0: every
    # component lays its mesh over all the devices (they take turns on them).
    trainer_devices: int = 0

    def __post_init__(self) -> None:
        for n in ("name", "namespace", "credentials_secret", "service_account"):
            if not _DNS_LABEL.fullmatch(getattr(self, n)) or len(getattr(self, n)) > 40:
                raise _bad(self, n, "must be a DNS label (a-z, 0-9, '-'; at most 40 characters)")
        for n in ("trainer_tpu", "inference_tpu"):
            if getattr(self, n) and not _TPU_SLICE.fullmatch(getattr(self, n)):
                raise _bad(self, n, "must be '' or '<v4|v5e|v5p|v6e>:<topology>', e.g. 'v5p:2x2x1'")
        _positive(self, "verifier_replicas", "controller_memory_gib")
        _non_negative(self, "param_server_memory_gib", "max_restarts", "trainer_devices")
        if not self.image:
            raise _bad(self, "image", "must be set")


@_frozen
class RunConfig:
    preset: str = "default"  # the config file's preset this config came from (informational)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    param_server: ParamServerConfig = dataclasses.field(default_factory=ParamServerConfig)
    verifiers: VerifierConfig = dataclasses.field(default_factory=VerifierConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    topology: TopologyConfig = dataclasses.field(default_factory=TopologyConfig)

    def __post_init__(self) -> None:
        """Rules that span components."""
        inf, model, ctl, alg = self.inference, self.model, self.controller, self.algorithm
        needed = inf.max_prompt_len + inf.max_new_tokens
        if needed > model.max_position_embeddings:
            raise ConfigError(
                "inference.max_new_tokens",
                f"max_prompt_len + max_new_tokens = {needed} exceeds "
                f"model.max_position_embeddings ({model.max_position_embeddings})",
                inf.max_new_tokens,
            )
        batch = ctl.prompts_per_step * alg.group_size
        if batch % self.trainer.micro_batch_size:
            raise ConfigError(
                "trainer.micro_batch_size",
                "must divide the rollouts per step "
                f"(controller.prompts_per_step * algorithm.group_size = {batch})",
                self.trainer.micro_batch_size,
            )
        for name, mesh in (("mesh", self.mesh), ("inference.mesh", inf.mesh)):
            tp, kv = mesh.tensor, model.num_kv_heads
            if tp != -1 and (model.num_heads % tp or (kv % tp and tp % kv)):
                raise ConfigError(
                    f"{name}.tensor",
                    f"must divide model.num_heads ({model.num_heads}) and divide or be a "
                    f"multiple of model.num_kv_heads ({kv})",
                    tp,
                )
        replicas = self.param_server.replicas
        if ctl.param_server_endpoints and len(ctl.param_server_endpoints) != replicas:
            raise ConfigError(
                "controller.param_server_endpoints",
                f"needs one endpoint per replica (param_server.replicas = {replicas}): a replica "
                "nobody publishes to never confirms progress, so no replica could collect versions",
                ctl.param_server_endpoints,
            )
        if inf.param_server_replica >= replicas:
            raise ConfigError(
                "inference.param_server_replica",
                f"must be < param_server.replicas ({replicas})",
                inf.param_server_replica,
            )
        if ctl.snapshot_keep < self.trainer.checkpoint_every + 1:
            raise ConfigError(
                "controller.snapshot_keep",
                "a resume needs a snapshot whose version has a trainer checkpoint: keep at least "
                f"trainer.checkpoint_every + 1 = {self.trainer.checkpoint_every + 1}",
                ctl.snapshot_keep,
            )
        span = self.trainer.keep_checkpoints * self.trainer.checkpoint_every
        if ctl.snapshot_keep > span:
            raise ConfigError(
                "controller.snapshot_keep",
                f"the oldest of {ctl.snapshot_keep} snapshots would be older than every kept "
                f"trainer checkpoint (trainer.keep_checkpoints {self.trainer.keep_checkpoints} x "
                f"checkpoint_every {self.trainer.checkpoint_every} = {span} steps), so no resume "
                f"could use it: keep at most {span} snapshots or more checkpoints",
                ctl.snapshot_keep,
            )
        needed_versions = ctl.pipeline_depth * (ctl.mode == "deterministic") + ctl.reload_staleness
        if ctl.transport == "local" and self.trainer.keep_checkpoints < needed_versions:
            raise ConfigError(
                "trainer.keep_checkpoints",
                "with the local transport a resumed run republishes the versions its unfinished "
                "work was generated with from the trainer's checkpoints: keep at least "
                f"pipeline_depth + reload_staleness = {needed_versions}",
                self.trainer.keep_checkpoints,
            )
        if self.inference.span_groups >= 2 and self.trainer.align_logprobs:
            raise ConfigError(
                "inference.span_groups",
                "span groups change the engine's f32 rounding with the batch, so the trainer's "
                "replay cannot reproduce its log-probs bitwise; set trainer.align_logprobs = False "
                "or span_groups = 0",
                self.inference.span_groups,
            )
        if self.topology.trainer_devices:
            if ctl.transport != "local" or ctl.trainer_process:
                raise ConfigError(
                    "topology.trainer_devices",
                    "splits one process's devices: it needs controller.transport 'local' and "
                    "trainer_process False",
                    self.topology.trainer_devices,
                )
            if -1 in (inf.mesh.data, inf.mesh.fsdp, inf.mesh.tensor):
                raise ConfigError(
                    "inference.mesh",
                    "needs explicit sizes (no -1) when topology.trainer_devices splits the devices",
                    (inf.mesh.data, inf.mesh.fsdp, inf.mesh.tensor),
                )
        if self.data.language not in self.verifiers.languages:
            raise ConfigError(
                "data.language",
                f"the verifiers do not run it (verifiers.languages = {self.verifiers.languages})",
                self.data.language,
            )
        if (
            self.data.replay
            and ctl.acceptance_staleness == UNBOUNDED
            and ctl.mode == "deterministic"
        ):
            raise ConfigError(
                "data.replay",
                "replay with unbounded staleness draws from an unbounded past, which "
                "deterministic mode cannot schedule; use mode 'throughput'",
                True,
            )
        if inf.continue_on_reload and ctl.mode != "throughput":
            raise ConfigError(
                "inference.continue_on_reload",
                "partial rollouts need controller.mode 'throughput': deterministic mode generates "
                "every step with one version and never reloads a worker under a running job",
                True,
            )

    @property
    def rollouts_per_step(self) -> int:
        return self.controller.prompts_per_step * self.algorithm.group_size

    @property
    def prompt_style(self) -> Literal["raw", "chat"]:
        """data.prompt_style with "auto" resolved: raw for a randomly initialized model (it has
        no chat format to follow), chat for pretrained weights."""
        if self.data.prompt_style != "auto":
            return self.data.prompt_style
        return "raw" if self.model.weights_format == "init" else "chat"


# ---------------------------------------------------------------------------------------------
# Dict <-> dataclass conversion with type checks.


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Builds dataclass ``cls`` from a (nested) mapping, checking keys, types and values.

    Raises ConfigError naming the dotted field path. Missing keys take their defaults.
    """
    if isinstance(data, ml_collections.ConfigDict):
        data = data.to_dict()
    if cls is RunConfig and not path and isinstance(data, Mapping):
        data = _fill_bucket(data)
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a section (mapping), got {type(data).__name__}", data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(where, f"unknown field{hint}")
        kwargs[key] = _convert(hints[key], value, where)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.prefixed(path) if path else e from None


BUCKET = "{bucket}"


def _fill_bucket(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with every "{bucket}" in its strings replaced by controller.bucket; ConfigError
    naming the fields that need it when it is unset."""
    bucket = str((data.get("controller") or {}).get("bucket", "") or "").rstrip("/")
    needing: list[str] = []

    def fill(value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            return {k: fill(v, f"{where}.{k}" if where else k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v, where) for v in value)
        if isinstance(value, str) and BUCKET in value:
            needing.append(f"{where} = {value!r}")
            return value.replace(BUCKET, bucket)
        return value

    filled = fill(data, "")
    if needing and not bucket:
        raise ConfigError(
            "controller.bucket",
            f"required by {', '.join(needing)}: give the run's storage, e.g. "
            "--config.controller.bucket=gs://my-bucket (or a local directory)",
            "",
        )
    return filled


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(where, f"must be one of {', '.join(map(repr, choices))}{hint}", value)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(where, f"expected a tuple, got {type(value).__name__}", value)
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(where, f"expected a float, got {type(value).__name__}", value)
        if math.isnan(value):
            raise ConfigError(where, "must be a number", value)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"expected an int, got {type(value).__name__}", value)
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(where, f"expected a {tp.__name__}, got {type(value).__name__}", value)
        return value
    raise TypeError(f"config field {where} has an unsupported annotation {tp!r}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (tuples kept)."""
    return {
        f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else v
        for f in dataclasses.fields(cfg)
    }


def diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted paths of fields whose values differ between two configs."""

    def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = flat(to_dict(a)), flat(to_dict(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def base_config_dict() -> ml_collections.ConfigDict:
    """A locked ConfigDict with every field of RunConfig at its default.

    Config files start from this, so an assignment to a misspelt field fails where it is made.
    """
    cfg = ml_collections.ConfigDict(to_dict(RunConfig()))
    cfg.lock()
    return cfg
