"""Errors of the parameter server; each names the gRPC status it is sent with."""

from __future__ import annotations

import grpc

# Trailing metadata that marks a status as the server's own (gRPC itself says RESOURCE_EXHAUSTED
# for an oversize message, which no retry cures).
TRAILER_KEY = "rlax-param-server-error"


class ParamServerError(Exception):
    """Base class. ``status`` is a ``grpc.StatusCode`` name."""

    status = "INTERNAL"


class InvalidArgument(ParamServerError):
    status = "INVALID_ARGUMENT"


class NotFound(ParamServerError):
    status = "NOT_FOUND"


class AlreadyExists(ParamServerError):
    status = "ALREADY_EXISTS"


class DataLoss(ParamServerError):
    """Bytes were lost or corrupted: a truncated stream or a checksum mismatch."""

    status = "DATA_LOSS"


class ResourceExhausted(ParamServerError):
    """No room for another hot version: nothing can be collected yet."""

    status = "RESOURCE_EXHAUSTED"


class FailedPrecondition(ParamServerError):
    """The call is well-formed but the store's state forbids it (e.g. reusing a version number)."""

    status = "FAILED_PRECONDITION"


BY_STATUS = {
    c.status: c
    for c in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        DataLoss,
        ResourceExhausted,
        FailedPrecondition,
    )
}


class Aborted(ParamServerError):
    """A conflicting call is in flight (e.g. the same version published twice at once); retry."""

    status = "ABORTED"


BY_STATUS[Aborted.status] = Aborted


class Unavailable(ParamServerError, grpc.RpcError):
    """Too few replicas could be reached (fewer than a push's quorum). Raised by the client only
    (no server sends it, so it is not in BY_STATUS), and a ``grpc.RpcError`` whose code is
    UNAVAILABLE like a lone unreachable server's own error: callers that handle a parameter
    server that is gone handle this one alike."""

    status = "UNAVAILABLE"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> tuple:
        return ()
