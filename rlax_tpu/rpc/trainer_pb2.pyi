from rlax_tpu.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerArray(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class TrainBatchMessage(_message.Message):
    __slots__ = ("tokens", "prompt_lengths", "completion_lengths", "behaviour_logprobs", "rewards", "versions", "group_size", "temperature", "loss_mask", "routes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    tokens: TrainerArray
    prompt_lengths: TrainerArray
    completion_lengths: TrainerArray
    behaviour_logprobs: TrainerArray
    rewards: TrainerArray
    versions: TrainerArray
    group_size: int
    temperature: float
    loss_mask: TrainerArray
    routes: TrainerArray
    def __init__(self, tokens: _Optional[_Union[TrainerArray, _Mapping]] = ..., prompt_lengths: _Optional[_Union[TrainerArray, _Mapping]] = ..., completion_lengths: _Optional[_Union[TrainerArray, _Mapping]] = ..., behaviour_logprobs: _Optional[_Union[TrainerArray, _Mapping]] = ..., rewards: _Optional[_Union[TrainerArray, _Mapping]] = ..., versions: _Optional[_Union[TrainerArray, _Mapping]] = ..., group_size: _Optional[int] = ..., temperature: _Optional[float] = ..., loss_mask: _Optional[_Union[TrainerArray, _Mapping]] = ..., routes: _Optional[_Union[TrainerArray, _Mapping]] = ...) -> None: ...

class TrainStepReply(_message.Message):
    __slots__ = ("metrics", "row_advantages")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ROW_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    row_advantages: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., row_advantages: _Optional[_Iterable[float]] = ...) -> None: ...

class TrainerSaveRequest(_message.Message):
    __slots__ = ("wait",)
    WAIT_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    def __init__(self, wait: _Optional[bool] = ...) -> None: ...

class TrainerRestoreRequest(_message.Message):
    __slots__ = ("step", "latest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    latest: bool
    def __init__(self, step: _Optional[int] = ..., latest: _Optional[bool] = ...) -> None: ...

class TrainerStep(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class TrainerStatusReply(_message.Message):
    __slots__ = ("step", "published_version", "mesh", "process_count", "halted", "checkpoint_steps", "last_metrics", "publishing", "publish_failed")
    class MeshEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    PROCESS_COUNT_FIELD_NUMBER: _ClassVar[int]
    HALTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHING_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FAILED_FIELD_NUMBER: _ClassVar[int]
    step: int
    published_version: int
    mesh: _containers.ScalarMap[str, int]
    process_count: int
    halted: str
    checkpoint_steps: _containers.RepeatedScalarFieldContainer[int]
    last_metrics: _containers.ScalarMap[str, float]
    publishing: _containers.RepeatedScalarFieldContainer[int]
    publish_failed: str
    def __init__(self, step: _Optional[int] = ..., published_version: _Optional[int] = ..., mesh: _Optional[_Mapping[str, int]] = ..., process_count: _Optional[int] = ..., halted: _Optional[str] = ..., checkpoint_steps: _Optional[_Iterable[int]] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., publishing: _Optional[_Iterable[int]] = ..., publish_failed: _Optional[str] = ...) -> None: ...
