from rlax_tpu.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArrayMeta(_message.Message):
    __slots__ = ("path", "shape", "dtype", "sharding", "shard_shape", "crc32")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    SHARD_SHAPE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    path: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    sharding: str
    shard_shape: _containers.RepeatedScalarFieldContainer[int]
    crc32: int
    def __init__(self, path: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., sharding: _Optional[str] = ..., shard_shape: _Optional[_Iterable[int]] = ..., crc32: _Optional[int] = ...) -> None: ...

class VersionHeader(_message.Message):
    __slots__ = ("version", "step", "arrays", "part")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    arrays: _containers.RepeatedCompositeFieldContainer[ArrayMeta]
    part: PartInfo
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., arrays: _Optional[_Iterable[_Union[ArrayMeta, _Mapping]]] = ..., part: _Optional[_Union[PartInfo, _Mapping]] = ...) -> None: ...

class PartInfo(_message.Message):
    __slots__ = ("index", "count", "boxes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    boxes: _containers.RepeatedCompositeFieldContainer[Slice]
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., boxes: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishTrailer(_message.Message):
    __slots__ = ("crc32",)
    CRC32_FIELD_NUMBER: _ClassVar[int]
    crc32: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, crc32: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    chunk: Chunk
    trailer: PublishTrailer
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[PublishTrailer, _Mapping]] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("version", "step", "nbytes", "persisted", "leased_by")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_FIELD_NUMBER: _ClassVar[int]
    LEASED_BY_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    nbytes: int
    persisted: bool
    leased_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., nbytes: _Optional[int] = ..., persisted: _Optional[bool] = ..., leased_by: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("info", "already_present", "complete")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    info: VersionInfo
    already_present: bool
    complete: bool
    def __init__(self, info: _Optional[_Union[VersionInfo, _Mapping]] = ..., already_present: _Optional[bool] = ..., complete: _Optional[bool] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("array", "start", "stop")
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    array: int
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, array: _Optional[int] = ..., start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("version", "slices", "header_only")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    HEADER_ONLY_FIELD_NUMBER: _ClassVar[int]
    version: int
    slices: _containers.RepeatedCompositeFieldContainer[Slice]
    header_only: bool
    def __init__(self, version: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ..., header_only: _Optional[bool] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    chunk: Chunk
    trailer: PullTrailer
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[PullTrailer, _Mapping]] = ...) -> None: ...

class PullTrailer(_message.Message):
    __slots__ = ("crc32c",)
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class VersionList(_message.Message):
    __slots__ = ("versions", "latest")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    latest: int
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., latest: _Optional[int] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("replica", "version", "missed")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    replica: int
    version: int
    missed: bool
    def __init__(self, replica: _Optional[int] = ..., version: _Optional[int] = ..., missed: _Optional[bool] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("consumer", "versions", "ttl_s")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, consumer: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("versions", "ttl_s")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...
