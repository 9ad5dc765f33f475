"""Metrics on a gs:// run directory (the GCS emulator), with the bytes the client uploads
measured by a proxy between it and the emulator."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlax_tpu import storage
from rlax_tpu.observability import metrics
from rlax_tpu.observability.metrics import MetricsWriter, read_metrics


class CountingProxy:
    """Forwards HTTP to ``upstream`` and records (method, path, body bytes) of each request.
    The emulator's resumable-upload URLs (Location headers) are pointed back at the proxy, so
    an upload's data goes through it too."""

    def __init__(self, upstream: str):
        up = urllib.parse.urlparse(upstream)
        self.requests: list[tuple[str, str, int]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                proxy.requests.append((self.command, self.path, len(body)))
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() in ("transfer-encoding", "connection", "content-length"):
                        continue
                    if k.lower() == "location":
                        v = v.replace(up.netloc, f"127.0.0.1:{self.server.server_address[1]}")
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def uploaded(self, prefix: str) -> tuple[int, int]:
        """(requests, body bytes) of uploads to object names starting with ``prefix``."""
        hits = [
            n
            for method, path, n in self.requests
            if method in ("POST", "PUT")
            and path.startswith("/upload/")
            and urllib.parse.parse_qs(urllib.parse.urlparse(path).query)
            .get("name", [""])[0]
            .startswith(prefix)
        ]
        return len(hits), sum(hits)


@pytest.fixture
def proxy(gcs_emulator, monkeypatch) -> Iterator[CountingProxy]:  # noqa: ANN001
    p = CountingProxy(gcs_emulator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
    yield p
    p.server.shutdown()
    p.server.server_close()


@pytest.fixture
def run_dir(gcs_emulator) -> str:  # noqa: ANN001, ARG001
    from ..conftest import GCS_BUCKET

    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:8]}/run"


def _log(w: MetricsWriter, steps: range, tag: float = 0.0) -> None:
    for s in steps:
        # About the size of a controller step's record: ~20 scalars and a staleness histogram.
        scalars = {f"k{i}": tag + s + i / 10 for i in range(20)}
        w.write(s, scalars, {"staleness": [0.0, 1.0, 1.0, 2.0] * 8}, wall_time=1.0 + s)


def _object_key(run_dir: str) -> str:
    return urllib.parse.urlparse(run_dir).path.lstrip("/")


def test_200_steps_upload_each_record_about_twice_and_read_back_in_order(proxy, run_dir):
    with MetricsWriter(run_dir) as w:
        _log(w, range(200))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(200))
    assert records[7]["scalars"]["k3"] == pytest.approx(7.3)
    final_bytes = sum(len(json.dumps(r)) + 1 for r in records)
    uploads, sent = proxy.uploaded(_object_key(run_dir) + "/metrics/")
    # One object per record, then one segment per 100 records; each upload is a resumable
    # session (2 requests). A whole-file rewrite per step sent 9.6 MB here (101x the records).
    assert uploads == 2 * (200 + 2)
    assert final_bytes < sent < 2.3 * final_bytes, (sent, final_bytes)
    names = sorted(p.name for p in storage.path(storage.join(run_dir, "metrics")).iterdir())
    assert names == ["000000-000000000-000000099.jsonl", "000000-000000100-000000199.jsonl"]
    # TensorBoard: one event file per segment, every step in it (read by TensorBoard's reader).
    tb_uploads, tb_sent = proxy.uploaded(_object_key(run_dir) + "/tensorboard/")
    assert tb_uploads == 2 * 2 and tb_sent < 2 * final_bytes
    acc = EventAccumulator(str(storage.local_copy(storage.join(run_dir, "tensorboard"))))
    acc.Reload()
    assert [e.step for e in acc.Scalars("k0")] == list(range(200))
    assert acc.Histograms("staleness")[-1].step == 199


def test_a_resume_drops_the_later_steps_once_and_rewrites_nothing(proxy, run_dir, monkeypatch):
    monkeypatch.setattr(metrics, "SEGMENT_RECORDS", 10)
    w = MetricsWriter(run_dir)
    _log(w, range(25))  # killed, never closed: segments 0-9 and 10-19, single objects 20-24
    before = len(proxy.requests)
    with MetricsWriter(run_dir, resume_after_step=17) as w2:
        _log(w2, range(18, 30), tag=1000.0)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(30))
    assert [r["scalars"]["k0"] for r in records[16:20]] == [16, 17, 1018, 1019]
    # The resumed writer uploaded its own records (twice) and a marker, nothing of the old run,
    # and deleted none of its objects.
    new = proxy.requests[before:]
    assert not any(m == "DELETE" and "%2F000000-" in p for m, p, _ in new)
    new_records = sum(len(json.dumps(r)) + 1 for r in records[18:])
    uploaded = sum(n for m, p, n in new if p.startswith("/upload/") and "metrics" in p)
    assert uploaded < 2.3 * new_records
    # A second resume before the first one's steps: both earlier epochs' later steps dropped.
    with MetricsWriter(run_dir, resume_after_step=5) as w3:
        _log(w3, range(6, 8), tag=2000.0)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(8))
    assert records[6]["scalars"]["k0"] == 2006


def test_leftovers_of_a_crash_mid_segment_and_torn_objects(run_dir, monkeypatch):
    monkeypatch.setattr(metrics, "SEGMENT_RECORDS", 10)
    with MetricsWriter(run_dir) as w:
        _log(w, range(10))
    segments = storage.path(storage.join(run_dir, "metrics"))
    # Killed between the segment's upload and its single-record objects' deletes.
    line = json.dumps({"step": 5, "wall_time": 0.0, "scalars": {}, "histograms": {}}) + "\n"
    storage.write_atomic(segments / "000000-000000005-000000005.jsonl", line)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(10))
    # A later epoch whose last object has a torn last line: that line is ignored.
    torn = segments / "000001-000000000-000000001.jsonl"
    storage.write_atomic(torn, line.replace('"step": 5', '"step": 10') + '{"step": 11, "wa')
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(11))
    storage.write_atomic(torn, '{"st\n' + line)
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        read_metrics(run_dir)


def test_a_metrics_jsonl_from_before_segments_is_read_first(run_dir):
    rows = [{"step": s, "wall_time": 0.0, "scalars": {}, "histograms": {}} for s in range(5)]
    storage.write_atomic(
        storage.join(run_dir, metrics.METRICS_FILE), "".join(json.dumps(r) + "\n" for r in rows)
    )
    with MetricsWriter(run_dir, resume_after_step=2) as w:
        w.write(3, {"x": 30.0})
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert read_metrics(storage.join(run_dir, "elsewhere")) == []
