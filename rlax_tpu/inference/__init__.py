"""Inference worker: paged KV cache, paged attention per backend, continuous batching, RL sampling.

Public API (what the controller and the trainer use):
  InferenceWorker(model, cfg.inference, weight_source=...) / InferenceWorker.from_config(run_cfg)
    .generate(requests, version=None) -> Iterator[Rollout]   streamed, num_samples per request
    .load_weights(version, params=None) -> int (aborted)     between engine steps
    .status() -> WorkerStatus;  .shutdown()
  InferenceClient(endpoint, credentials=...)                 the same calls over gRPC
  Request(prompt_id, prompt_tokens, num_samples, sampling), SamplingParams(...)
  WeightSource (Protocol: fetch(version) -> params), DictWeightSource
  Errors: InvalidRequest, UnknownVersion, VersionMismatch, WorkerShutdown
How reported log-probs are computed (and replayed bitwise): see ``engine.py`` and ``replay.py``.

Modules: pages (host allocator; the device cache, paged attention and the programs are in
``models``, shared with the trainer), scheduler, sampler, engine, worker, service, replay.
"""

from rlax_tpu.inference.engine import Engine, InvalidRequest, InvalidWeights
from rlax_tpu.inference.replay import replay_logits, temperature_scaled_logprobs
from rlax_tpu.inference.sampler import LOGPROB_POLICIES, SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.service import InferenceClient, serve
from rlax_tpu.inference.worker import (
    DictWeightSource,
    InferenceWorker,
    UnknownVersion,
    VersionMismatch,
    WeightSource,
    WorkerShutdown,
    WorkerStatus,
)

__all__ = [
    "LOGPROB_POLICIES",
    "DictWeightSource",
    "Engine",
    "InferenceClient",
    "InferenceWorker",
    "InvalidRequest",
    "InvalidWeights",
    "Request",
    "SamplingParams",
    "UnknownVersion",
    "VersionMismatch",
    "WeightSource",
    "WorkerShutdown",
    "WorkerStatus",
    "replay_logits",
    "serve",
    "temperature_scaled_logprobs",
]
