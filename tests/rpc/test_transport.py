"""Real gRPC servers on 127.0.0.1: token auth, TLS, unreachable components, stub freshness."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from rlax_tpu.rpc import codegen
from rlax_tpu.rpc.transport import (
    ComponentUnreachable,
    Credentials,
    CredentialsError,
    chunks,
    make_channel,
    make_server,
    wait_ready,
)

SERVICE = "test.Echo"


def _add_echo(server: grpc.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req[::-1]),
        "Stream": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([req, req])),
        "Upload": grpc.stream_unary_rpc_method_handler(lambda it, ctx: b"".join(it)),
        "Bidi": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (x.upper() for x in it)),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _calls(channel: grpc.Channel) -> dict[str, object]:
    unary = channel.unary_unary(f"/{SERVICE}/Unary")
    stream = channel.unary_stream(f"/{SERVICE}/Stream")
    upload = channel.stream_unary(f"/{SERVICE}/Upload")
    bidi = channel.stream_stream(f"/{SERVICE}/Bidi")
    return {
        "unary": lambda: unary(b"abc", timeout=10),
        "stream": lambda: list(stream(b"x", timeout=10)),
        "upload": lambda: upload(iter([b"a", b"b"]), timeout=10),
        "bidi": lambda: list(bidi(iter([b"a", b"b"]), timeout=10)),
    }


EXPECTED = {"unary": b"cba", "stream": [b"x", b"x"], "upload": b"ab", "bidi": [b"A", b"B"]}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return path


def test_plain_loopback_server_round_trip():
    server, port = make_server("127.0.0.1:0", _add_echo)
    try:
        calls = _calls(make_channel(f"127.0.0.1:{port}"))
        assert {k: f() for k, f in calls.items()} == EXPECTED
    finally:
        server.stop(None)


def test_token_is_required_on_every_call_shape(token_file: Path, tmp_path: Path):
    creds = Credentials(auth_token_file=str(token_file))
    server, port = make_server("127.0.0.1:0", _add_echo, credentials=creds)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    try:
        good = _calls(make_channel(f"127.0.0.1:{port}", credentials=creds))
        assert {k: f() for k, f in good.items()} == EXPECTED
        for channel in (
            make_channel(f"127.0.0.1:{port}"),
            make_channel(f"127.0.0.1:{port}", credentials=Credentials(auth_token_file=str(wrong))),
        ):
            for name, call in _calls(channel).items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    finally:
        server.stop(None)


def test_tls_with_token(token_file: Path, tmp_path: Path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(cert.read_bytes() + key.read_bytes())
    creds = Credentials(auth_token_file=str(token_file), tls_cert_file=str(bundle))
    server, port = make_server("localhost:0", _add_echo, credentials=creds)
    try:
        calls = _calls(make_channel(f"localhost:{port}", credentials=creds))
        assert calls["unary"]() == b"cba"
        # A plaintext client cannot talk to the TLS server.
        with pytest.raises(grpc.RpcError) as info:
            _calls(make_channel(f"localhost:{port}"))["unary"]()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_unreachable_component_is_named_not_a_hang():
    server, port = make_server("127.0.0.1:0", _add_echo)
    server.stop(None)  # the port is now closed
    channel = make_channel(f"127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(ComponentUnreachable) as info:
        wait_ready(channel, component="param_server", endpoint=f"127.0.0.1:{port}", timeout_s=0.5)
    assert time.monotonic() - start < 30  # bounded: it raised instead of hanging
    assert str(info.value) == f"param_server at 127.0.0.1:{port} did not answer within 0.5 s"


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), ("", "one non-empty token"), ("a b", "one non-empty token")],
)
def test_bad_token_file(tmp_path: Path, content: str | None, message: str):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CredentialsError, match=message):
        make_server("127.0.0.1:0", _add_echo, credentials=Credentials(auth_token_file=str(path)))


def test_tls_file_without_key_is_rejected(tmp_path: Path):
    path = tmp_path / "cert.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(CredentialsError, match="must hold a certificate and its private key"):
        make_server("127.0.0.1:0", _add_echo, credentials=Credentials(tls_cert_file=str(path)))


def test_chunks_are_views_that_reassemble():
    data = bytes(range(256)) * 10
    parts = chunks(data, 1000)
    assert [len(p) for p in parts] == [1000, 1000, 560]
    assert b"".join(parts) == data
    assert [len(p) for p in chunks(b"", 10)] == [0]
    with pytest.raises(ValueError):
        chunks(data, 0)


def test_committed_stubs_match_the_protos():
    assert codegen.stale_stubs() == []


def test_a_call_to_a_peer_that_just_stopped_ends_within_its_deadline():
    """A channel connects, the server stops, a fresh channel to the same endpoint calls it: the
    call must end (UNAVAILABLE or DEADLINE_EXCEEDED) within its deadline. With gRPC's shared
    subchannel pool about 1 in 100 such calls hung past the deadline and past cancel() on a busy
    host (grpcio 1.85); a parameter-server reader failing over from a dead replica does this."""
    hung = []
    for i in range(60):
        server, port = make_server("127.0.0.1:0", _add_echo)
        endpoint = f"127.0.0.1:{port}"
        first = make_channel(endpoint)
        wait_ready(first, component="echo", endpoint=endpoint, timeout_s=10)
        server.stop(None).wait()
        second = make_channel(endpoint)
        stream = second.unary_stream(f"/{SERVICE}/Stream")(b"x", timeout=2)
        codes: list[grpc.StatusCode] = []

        def drain(stream=stream, codes=codes) -> None:
            try:
                list(stream)
            except grpc.RpcError as e:
                codes.append(e.code())

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        reader.join(30)
        if reader.is_alive():
            hung.append(i)
        else:
            assert codes and codes[0] in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        first.close()
        second.close()
    assert not hung, f"calls {hung} outlived their 2 s deadline by 28 s"


class _SlowProxy:
    """A TCP relay to ``target`` that holds the server's first bytes (its HTTP/2 SETTINGS
    frame) for ``delay_s``: a server on a loaded host that is slow to answer a new connection."""

    def __init__(self, target: tuple[str, int], delay_s: float):
        self.target, self.delay_s = target, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self.delay_s), daemon=True
            ).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(delay_s)
                delay_s = 0.0
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_a_server_slow_to_answer_a_new_connection_is_still_reached():
    """gRPC core gives a connection attempt max(its backoff, grpc.min_reconnect_backoff_ms) to
    receive the server's SETTINGS frame (src/core/client_channel/subchannel.cc,
    ParseArgsForBackoffValues: the option is the minimum connect timeout). With 250 ms there, a
    parameter server on a loaded host answering in 1 s failed every publish with "connection
    attempt timed out before receiving SETTINGS frame" (tests/trainer/test_distributed.py on a
    busy CI host)."""
    server, port = make_server("127.0.0.1:0", _add_echo)
    proxy = _SlowProxy(("127.0.0.1", port), delay_s=1.0)
    try:
        unary = make_channel(f"127.0.0.1:{proxy.port}").unary_unary(f"/{SERVICE}/Unary")
        assert unary(b"abc", timeout=10) == b"cba"
    finally:
        proxy.close()
        server.stop(None)
