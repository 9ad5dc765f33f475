from rlax_tpu.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed", "logprob_policy", "stop_sequences", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_POLICY_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    seed: int
    logprob_policy: str
    stop_sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ..., logprob_policy: _Optional[str] = ..., stop_sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptRequest(_message.Message):
    __slots__ = ("prompt_id", "prompt_tokens", "num_samples", "sampling", "continuation", "keep_pages")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    KEEP_PAGES_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    sampling: SamplingParams
    continuation: _containers.RepeatedScalarFieldContainer[int]
    keep_pages: bool
    def __init__(self, prompt_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., continuation: _Optional[_Iterable[int]] = ..., keep_pages: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "version")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptRequest]
    version: int
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptRequest, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("step", "start")
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    step: int
    start: bool
    def __init__(self, step: _Optional[int] = ..., start: _Optional[bool] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("prompt_id", "sample_index", "prompt_tokens", "tokens", "logprobs", "versions", "finish_reason", "logprob_policy", "routes", "routes_shape")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_SHAPE_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    sample_index: int
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprob_policy: str
    routes: bytes
    routes_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprob_policy: _Optional[str] = ..., routes: _Optional[bytes] = ..., routes_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "relay_sources")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RELAY_SOURCES_FIELD_NUMBER: _ClassVar[int]
    version: int
    relay_sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., relay_sources: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadWeightsReply(_message.Message):
    __slots__ = ("version", "aborted", "weight_bytes_received")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    version: int
    aborted: int
    weight_bytes_received: int
    def __init__(self, version: _Optional[int] = ..., aborted: _Optional[int] = ..., weight_bytes_received: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "running", "waiting", "pages_total", "pages_free", "compilations", "steps", "generated_tokens", "preemptions", "pages_shared", "backend", "serving", "rows_bitwise", "prefix_tokens_reused")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    COMPILATIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PAGES_SHARED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ROWS_BITWISE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_REUSED_FIELD_NUMBER: _ClassVar[int]
    version: int
    running: int
    waiting: int
    pages_total: int
    pages_free: int
    compilations: int
    steps: int
    generated_tokens: int
    preemptions: int
    pages_shared: int
    backend: str
    serving: bool
    rows_bitwise: bool
    prefix_tokens_reused: int
    def __init__(self, version: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., compilations: _Optional[int] = ..., steps: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., pages_shared: _Optional[int] = ..., backend: _Optional[str] = ..., serving: _Optional[bool] = ..., rows_bitwise: _Optional[bool] = ..., prefix_tokens_reused: _Optional[int] = ...) -> None: ...
