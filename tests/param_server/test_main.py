"""``python -m rlax_tpu.param_server`` starts, answers health and stops cleanly on SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from rlax_tpu.cli import EXIT_STOPPED
from rlax_tpu.param_server.client import ParamServerClient
from tests.param_server.conftest import assert_same_tree, make_tree

REPO = Path(__file__).resolve().parents[2]


def test_command_serves_health_and_stops_on_sigterm(tmp_path: Path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tpu.param_server",
            "--config=configs/codeforces.py:local",
            f"--config.param_server.persist_path={tmp_path / 'ps'}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(r"param_server listening on (127\.0\.0\.1:\d+)\n", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        with ParamServerClient(match.group(1)) as client:
            client.wait_ready(timeout_s=30)
            (health,) = client.health()
            assert health.component == "param_server" and health.serving
            client.push(make_tree(0), 0)
            assert_same_tree(client.pull(), make_tree(0))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == EXIT_STOPPED, proc.stderr.read()
        assert (tmp_path / "ps" / "v000000000000" / "manifest.json").is_file()  # persist_every=1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
