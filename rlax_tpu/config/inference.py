"""The inference section: workers, their engines and sampling."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlax_tpu.config.checks import (
    ConfigError,
    bad,
    check_address,
    frozen,
    non_negative,
    positive,
)
from rlax_tpu.config.mesh import DistributedConfig, MeshConfig, one_device


@frozen
class InferenceConfig:
    num_workers: int = 1  # inference workers (engines), each on its own devices
    # "tpu_emulated": the TPU cache layout and packing with an XLA stand-in for the kernel (tests
    # of the TPU path on CPU; see models/paged_attention.py).
    backend: Literal["auto", "cpu", "gpu", "tpu", "tpu_emulated"] = "auto"
    # Each worker's device mesh (the first data*fsdp*expert*tensor devices it sees; -1: all):
    # weights and KV pages split over heads on tensor, decode rows over data; fsdp must be 1
    # (decode would all-gather the weights at every step). Default one device.
    mesh: MeshConfig = dataclasses.field(default_factory=one_device)
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
    # Without continue_on_reload: a reload does not wait for the running requests (no drain).
    # They finish on the weights they started on, which the worker keeps (a second copy, one
    # older version at most; the next version's fetch ahead waits for it to go) while the new
    # version's requests run beside them. A step with both versions runs two programs (a second
    # read of the weights): it pays where a step is bound by its rows' KV reads (long contexts),
    # not where the weights or padded rows bind (benchmarks/RESULTS.md, "Reloads without
    # draining": 9% slower on CPU). Throughput mode only (ignored in deterministic mode, which
    # runs one job at a time); False: a worker finishes a version's jobs before it loads the next.
    overlap_reload: bool = False
    address: str = "127.0.0.1:0"  # gRPC address a worker serves on (distributed transport)
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain

    def __post_init__(self) -> None:
        positive(
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
        non_negative(
            self, "top_k", "step_tokens", "prefill_rows", "span_groups", "attention_block_pages"
        )
        positive(self, "span_bucket_pages")
        if self.attention_kernel not in ("auto", "native", "xla"):
            raise bad(self, "attention_kernel", "must be 'auto', 'native' or 'xla'")
        if self.param_server_replica < -1:
            raise bad(self, "param_server_replica", "must be >= 0, or -1 for automatic")
        if self.mesh.fsdp != 1:
            # Decode reads every weight once per token step: weights split over fsdp would be
            # all-gathered at every step (the whole model over the interconnect per token).
            raise ConfigError(
                "mesh.fsdp",
                "must be 1: an inference worker would all-gather its fsdp-sharded weights at "
                "every decode step; split them over mesh.tensor, or add workers",
                self.mesh.fsdp,
            )
        if not -1 <= self.worker_index < self.num_workers:
            raise bad(
                self, "worker_index", f"must be in [0, num_workers={self.num_workers}), or -1"
            )
        if self.span_groups > self.max_concurrent_seqs:
            raise bad(
                self, "span_groups", f"must be <= max_concurrent_seqs ({self.max_concurrent_seqs})"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise bad(self, "top_p", "must be in (0, 1]")
        if self.step_tokens and self.step_tokens < self.max_concurrent_seqs:
            raise bad(
                self,
                "step_tokens",
                f"must be 0 or >= max_concurrent_seqs ({self.max_concurrent_seqs}): every running "
                "sequence decodes one token per step",
            )
        rows, data = self.step_tokens or self.max_concurrent_seqs, self.mesh.data
        for name, n in (("step_tokens", rows), ("prefill_rows", self.prefill_rows)):
            if data > 1 and n % data:  # the engine's data shards each take a block of rows
                raise ConfigError(
                    name,
                    f"must divide by mesh.data = {data}: each data shard of the engine takes "
                    f"{name} / {data} rows (step_tokens 0: max_concurrent_seqs)",
                    n,
                )
        if data > 1 and self.span_groups > rows // data:
            raise bad(self, "span_groups", f"must be <= a data shard's {rows // data} rows")
        check_address(self, "address", self.auth_token_file, self.tls_cert_file)
