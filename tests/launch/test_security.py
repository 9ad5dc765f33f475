"""No open doors, as deployed: services refuse to listen off loopback without credentials, and a
parameter server started as on GKE (TLS, a token, a publish token) refuses whoever lacks one of
them, leaving its store unchanged; the pods' health probe gets through with the credentials."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.rpc.transport import Credentials
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
CONFIG = "--config=configs/codeforces.py:local"
SERVICE_NAME = "rlax-param-server-0.rlax.svc"


def _env() -> dict[str, str]:
    return child_env()


@pytest.mark.parametrize("section", ["param_server", "trainer", "inference", "verifiers"])
def test_a_service_off_loopback_without_a_token_refuses_to_start(section):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"rlax_tpu.{section}",
            CONFIG,
            f"--config.{section}.address=0.0.0.0:0",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"{section}.address = '0.0.0.0:0': a non-loopback address needs credentials" in done.stderr
    )


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    """What the GKE Secret holds, made by deploy/gke/make-credentials.sh: a token, a publish
    token and a certificate for the namespace's Services (*.rlax.svc) with its key."""
    d = tmp_path_factory.mktemp("secrets")
    subprocess.run(
        ["bash", str(REPO / "deploy" / "gke" / "make-credentials.sh"), str(d)],
        check=True,
        capture_output=True,
    )
    assert sorted(p.name for p in d.iterdir()) == ["publish-token", "tls.pem", "token"]
    return d


@pytest.fixture(scope="module")
def param_server(secrets, tmp_path_factory):
    """`python -m rlax_tpu.param_server` with the GKE credentials, on loopback."""
    run_dir = tmp_path_factory.mktemp("ps")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.param_server",
            CONFIG,
            f"--config.controller.run_dir={run_dir}",
            "--config.param_server.address=127.0.0.1:0",
            f"--config.param_server.auth_token_file={secrets / 'token'}",
            f"--config.param_server.tls_cert_file={secrets / 'tls.pem'}",
            f"--config.param_server.publish_token_file={secrets / 'publish-token'}",
            "--config.param_server.persist_every=0",
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        assert line, "param_server exited before it served"
    port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
    yield port
    proc.terminate()
    proc.wait(timeout=60)


def _client(
    port: int, secrets: Path, *, token: bool = True, publish: bool = True, tls: bool = True
) -> ParamServerClient:
    creds = Credentials(
        auth_token_file=str(secrets / "token") if token else "",
        tls_cert_file=str(secrets / "tls.pem") if tls else "",
    )
    client = ParamServerClient(
        f"127.0.0.1:{port}",
        credentials=creds,
        timeout_s=20,
        publish_token_file=str(secrets / "publish-token") if publish else "",
    )
    return client


@pytest.fixture()
def channel_name_override(monkeypatch):
    """Every channel the client opens checks the certificate against the Service's name (it
    names the Service, not 127.0.0.1; the pods' own probe does the same)."""
    import rlax_tpu.param_server.client as client_module
    from rlax_tpu.rpc import transport

    def make_channel(endpoint, **kwargs):  # noqa: ANN001, ANN202
        return transport.make_channel(endpoint, server_name=SERVICE_NAME, **kwargs)

    monkeypatch.setattr(client_module, "make_channel", make_channel)


def _params() -> dict[str, np.ndarray]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}


def test_a_client_without_the_token_is_refused_and_the_store_is_unchanged(
    param_server, secrets, channel_name_override
):
    full = _client(param_server, secrets)
    assert full.list_versions()[0] == []
    no_token = _client(param_server, secrets, token=False)
    with pytest.raises(grpc.RpcError) as e:
        no_token.push(_params(), 1)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        no_token.list_versions()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A worker's credentials (the token, not the publish token) read but cannot write.
    reader = _client(param_server, secrets, publish=False)
    with pytest.raises(grpc.RpcError) as e:
        reader.push(_params(), 1)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the write token" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        reader.report_progress(0, 5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert full.list_versions()[0] == []  # nothing was written
    # The trainer's credentials publish; the reader then pulls what it wrote.
    full.push(_params(), 1)
    assert [v.version for v in full.list_versions()[0]] == [1]
    np.testing.assert_array_equal(reader.pull(1)["w"], _params()["w"])
    for c in (full, no_token, reader):
        c.close()


def test_plaintext_is_refused(param_server, secrets):
    plain = _client(param_server, secrets, tls=False)
    with pytest.raises(grpc.RpcError) as e:
        plain.list_versions()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()


def _probe(port: int, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlax_tpu.rpc.probe", "ParamServer", f"127.0.0.1:{port}", *flags],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_pods_health_probe(param_server, secrets):
    creds = [f"--token_file={secrets / 'token'}", f"--tls_cert_file={secrets / 'tls.pem'}"]
    # A fresh process's TLS handshake can take seconds beside a busy suite (the probe's 5 s
    # default gave "handshaker shutdown" once): the pods' probes set their own timeout.
    ok = _probe(param_server, *creds, f"--server_name={SERVICE_NAME}", "--timeout_s=30")
    assert ok.returncode == 0 and "serving" in ok.stdout, ok.stdout + ok.stderr
    no_token = _probe(param_server, creds[1], f"--server_name={SERVICE_NAME}")
    assert no_token.returncode == 1 and "unhealthy" in no_token.stderr
    wrong_name = _probe(param_server, *creds, "--server_name=elsewhere.example.com")
    assert wrong_name.returncode == 1
    follower = subprocess.run(
        [sys.executable, "-m", "rlax_tpu.rpc.probe", "Trainer", "127.0.0.1:1", "--lead_only"],
        cwd=REPO,
        env={**_env(), "JOB_COMPLETION_INDEX": "3"},
        capture_output=True,
        text=True,
    )
    assert follower.returncode == 0 and "follower" in follower.stdout
