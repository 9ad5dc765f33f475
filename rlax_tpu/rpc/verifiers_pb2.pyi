from rlax_tpu.rpc import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UploadChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Link(_message.Message):
    __slots__ = ("link",)
    LINK_FIELD_NUMBER: _ClassVar[int]
    link: str
    def __init__(self, link: _Optional[str] = ...) -> None: ...

class Links(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, links: _Optional[_Iterable[str]] = ...) -> None: ...

class TestLinks(_message.Message):
    __slots__ = ("input", "answer")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    input: str
    answer: str
    def __init__(self, input: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class ProblemSpec(_message.Message):
    __slots__ = ("problem_id", "tests", "checker", "checker_language", "testlib", "time_limit_s", "memory_limit_mb")
    PROBLEM_ID_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    CHECKER_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TESTLIB_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    problem_id: str
    tests: _containers.RepeatedCompositeFieldContainer[TestLinks]
    checker: str
    checker_language: str
    testlib: str
    time_limit_s: float
    memory_limit_mb: int
    def __init__(self, problem_id: _Optional[str] = ..., tests: _Optional[_Iterable[_Union[TestLinks, _Mapping]]] = ..., checker: _Optional[str] = ..., checker_language: _Optional[str] = ..., testlib: _Optional[str] = ..., time_limit_s: _Optional[float] = ..., memory_limit_mb: _Optional[int] = ...) -> None: ...

class CodeTask(_message.Message):
    __slots__ = ("problem", "language", "code")
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    problem: ProblemSpec
    language: str
    code: str
    def __init__(self, problem: _Optional[_Union[ProblemSpec, _Mapping]] = ..., language: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class UnitTestTask(_message.Message):
    __slots__ = ("code", "test", "entry_point", "time_limit_s")
    CODE_FIELD_NUMBER: _ClassVar[int]
    TEST_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    code: str
    test: str
    entry_point: str
    time_limit_s: float
    def __init__(self, code: _Optional[str] = ..., test: _Optional[str] = ..., entry_point: _Optional[str] = ..., time_limit_s: _Optional[float] = ...) -> None: ...

class MathTask(_message.Message):
    __slots__ = ("response", "answer")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    response: str
    answer: str
    def __init__(self, response: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class RunTask(_message.Message):
    __slots__ = ("language", "code", "stdin", "time_limit_s")
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    language: str
    code: str
    stdin: str
    time_limit_s: float
    def __init__(self, language: _Optional[str] = ..., code: _Optional[str] = ..., stdin: _Optional[str] = ..., time_limit_s: _Optional[float] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("code", "unit_test", "math", "run")
    CODE_FIELD_NUMBER: _ClassVar[int]
    UNIT_TEST_FIELD_NUMBER: _ClassVar[int]
    MATH_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    code: CodeTask
    unit_test: UnitTestTask
    math: MathTask
    run: RunTask
    def __init__(self, code: _Optional[_Union[CodeTask, _Mapping]] = ..., unit_test: _Optional[_Union[UnitTestTask, _Mapping]] = ..., math: _Optional[_Union[MathTask, _Mapping]] = ..., run: _Optional[_Union[RunTask, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("tasks", "deadline_s")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    deadline_s: float
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("kind", "detail", "time_s", "memory_bytes", "tests_passed", "tests_total", "score")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TESTS_PASSED_FIELD_NUMBER: _ClassVar[int]
    TESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    detail: str
    time_s: float
    memory_bytes: int
    tests_passed: int
    tests_total: int
    score: float
    def __init__(self, kind: _Optional[str] = ..., detail: _Optional[str] = ..., time_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., tests_passed: _Optional[int] = ..., tests_total: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("verdicts",)
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ...) -> None: ...
