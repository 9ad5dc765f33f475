"""gRPC servers and channels shared by every service: loopback by default, token auth, optional TLS.

No open doors: a server binds to its configured address; the config only accepts a non-loopback
address together with credentials (``auth_token_file`` and/or ``tls_cert_file``). With a token, every
call must carry ``authorization: Bearer <token>`` metadata or it fails with UNAUTHENTICATED. With TLS,
``tls_cert_file`` is a PEM bundle holding the certificate chain and its private key (server side);
clients trust the certificate in the same file.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import re
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
_AUTH_KEY = "authorization"


class ComponentUnreachable(ConnectionError):
    """A component did not answer at its endpoint in time."""

    def __init__(self, component: str, endpoint: str, timeout_s: float):
        self.component, self.endpoint = component, endpoint
        super().__init__(f"{component} at {endpoint} did not answer within {timeout_s:g} s")


class ComponentFailed(ConnectionError):
    """A component stopped answering during the run (its process died or its host went away)."""

    def __init__(self, component: str, endpoint: str, code: str, details: str):
        self.component, self.endpoint = component, endpoint
        super().__init__(f"{component} at {endpoint} stopped answering ({code}: {details})")


_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Named:
    """``target`` (a client) whose calls raise :class:`ComponentFailed`, naming the component
    and its endpoint, where gRPC reports it gone (UNAVAILABLE, DEADLINE_EXCEEDED); every other
    outcome passes through unchanged."""

    def __init__(self, target: Any, component: str, endpoint: str):
        self._target, self._component, self._endpoint = target, component, endpoint

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except grpc.RpcError as e:
                if e.code() not in _GONE:
                    raise
                raise ComponentFailed(
                    self._component, self._endpoint, e.code().name, e.details() or ""
                ) from None

        return call


class CredentialsError(ValueError):
    """A token or certificate file is missing, empty or malformed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Credentials:
    """What a server demands and a client presents. Empty fields mean "not used"."""

    auth_token_file: str = ""
    tls_cert_file: str = ""

    def token(self) -> str | None:
        if not self.auth_token_file:
            return None
        path = Path(self.auth_token_file)
        if not path.is_file():
            raise CredentialsError(f"auth_token_file {path} does not exist")
        token = path.read_text().strip()
        if not token or any(c.isspace() for c in token):
            raise CredentialsError(f"auth_token_file {path} must hold one non-empty token")
        return token

    def _pem(self) -> bytes:
        path = Path(self.tls_cert_file)
        if not path.is_file():
            raise CredentialsError(f"tls_cert_file {path} does not exist")
        return path.read_bytes()

    def server_tls(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert_file:
            return None
        pem = self._pem()
        key = _pem_blocks(pem, "PRIVATE KEY")
        cert = _pem_blocks(pem, "CERTIFICATE")
        if not key or not cert:
            raise CredentialsError(
                f"tls_cert_file {self.tls_cert_file} must hold a certificate and its private key"
            )
        return grpc.ssl_server_credentials([(key, cert)])

    def channel_tls(self) -> grpc.ChannelCredentials | None:
        if not self.tls_cert_file:
            return None
        cert = _pem_blocks(self._pem(), "CERTIFICATE")
        if not cert:
            raise CredentialsError(f"tls_cert_file {self.tls_cert_file} holds no certificate")
        return grpc.ssl_channel_credentials(root_certificates=cert)


def _pem_blocks(pem: bytes, kind: str) -> bytes:
    pattern = (
        rb"-----BEGIN [A-Z ]*"
        + kind.encode()
        + rb"-----.*?-----END [A-Z ]*"
        + kind.encode()
        + rb"-----\s*"
    )
    return b"".join(m.group(0) for m in re.finditer(pattern, pem, re.S))


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(_request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        presented = dict(handler_call_details.invocation_metadata or ()).get(_AUTH_KEY, "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        # Answer with the handler's own streaming shape so the client sees a clean status.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._deny(it, ctx))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(lambda r, ctx: self._deny(r, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)


WRITE_TOKEN_KEY = "x-rlax-write-token"


class _WriteTokenCheck(grpc.ServerInterceptor):
    """Methods that change state (``methods``, full names) also need ``WRITE_TOKEN_KEY``
    metadata holding ``token``: a second credential, given only to the writer."""

    def __init__(self, token: str, methods: Sequence[str]):
        self._expected, self._methods = token.encode(), frozenset(methods)

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get(WRITE_TOKEN_KEY, "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return handler

        def deny(_request: Any, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{handler_call_details.method} needs the write token",
            )

        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def make_server(
    address: str,
    add_servicers: Callable[[grpc.Server], None],
    *,
    credentials: Credentials = Credentials(),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = 8,
    write_token: str | None = None,
    write_methods: Sequence[str] = (),
) -> tuple[grpc.Server, int]:
    """Builds, binds and starts a server. Returns (server, bound port); port 0 picks a free one.

    ``write_token``: ``write_methods`` (full method names, unary or client-streaming) also need
    it, as ``WRITE_TOKEN_KEY`` metadata (PERMISSION_DENIED otherwise).
    """
    token = credentials.token()
    interceptors: list[grpc.ServerInterceptor] = [_TokenCheck(token)] if token else []
    if write_token:
        interceptors.append(_WriteTokenCheck(write_token, write_methods))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=interceptors,
        options=_channel_options(max_message_bytes),
    )
    add_servicers(server)
    tls = credentials.server_tls()
    port = server.add_secure_port(address, tls) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind a gRPC server to {address}")
    server.start()
    return server, port


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _TokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str):
        self._pair = (_AUTH_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._pair],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request_iterator)


def make_channel(
    endpoint: str,
    *,
    credentials: Credentials = Credentials(),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    server_name: str = "",
) -> grpc.Channel:
    """A channel to ``endpoint`` that presents the configured token and trusts the configured cert.

    ``server_name``: the name the server's certificate must carry when it differs from the
    endpoint's host (a pod probing itself on 127.0.0.1 with a certificate for its Service name).
    """
    # A restarted peer (a rescheduled pod) is found again within ~2 s, not after gRPC's default
    # reconnect backoff of up to 120 s. "min_reconnect_backoff_ms" is no backoff: gRPC core reads
    # it as the least time a connection attempt gets to receive the server's SETTINGS frame
    # (subchannel.cc, ParseArgsForBackoffValues); at 250 ms a server on a loaded host failed
    # every call (tests/rpc/test_transport.py). Its default, 20 s.
    # Its own subchannels, not gRPC's process-wide pool: a call on a fresh channel to a peer
    # that had just stopped, sharing the subchannel of an older channel, hung past its deadline
    # and its cancel() in about 1 of 100 tries on a busy host (grpcio 1.85; 0 of 800 with a
    # local pool; tests/rpc/test_transport.py).
    options = [
        *_channel_options(max_message_bytes),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 20_000),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    tls = credentials.channel_tls()
    channel = (
        grpc.secure_channel(endpoint, tls, options=options)
        if tls
        else grpc.insecure_channel(endpoint, options=options)
    )
    token = credentials.token()
    return grpc.intercept_channel(channel, _TokenMetadata(token)) if token else channel


def wait_ready(channel: grpc.Channel, *, component: str, endpoint: str, timeout_s: float) -> None:
    """Blocks until the channel connects; raises ComponentUnreachable naming the component."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError as e:
        raise ComponentUnreachable(component, endpoint, timeout_s) from e


def chunks(data: bytes | memoryview, chunk_bytes: int) -> Sequence[memoryview]:
    """Splits a buffer into views of at most ``chunk_bytes`` (no copies)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    view = memoryview(data).cast("B")
    return [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)] or [view[:0]]
