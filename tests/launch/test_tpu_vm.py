"""deploy/tpu_vm: the scripts' commands (DRY_RUN=1 prints them) and the config they start."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "deploy" / "tpu_vm"
ENV = {"NAME": "rl-vm", "ZONE": "us-east5-a", "BUCKET": "gs://my-bucket", "DRY_RUN": "1",
       "REPO_URL": "https://example.com/rlax_tpu.git"}  # fmt: skip


def _script(name: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPTS / name)], env=os.environ | ENV | env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _gcloud(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ gcloud")]


def test_create_setup_and_stop_name_the_vm():
    (create,) = _gcloud(_script("create.sh", ACCELERATOR="v6e-8", RUNTIME="v2-alpha-tpuv6e",
                                SPOT="1").stdout)  # fmt: skip
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert create[create.index("--accelerator-type"):][:2] == ["--accelerator-type", "v6e-8"]
    assert "--spot" in create and "rl-vm" in create
    (setup,) = _gcloud(_script("setup.sh").stdout)
    assert setup[setup.index("--worker") + 1] == "all"
    assert "https://example.com/rlax_tpu.git" in setup[-1] and "make setup" in setup[-1]
    stop = _gcloud(_script("stop.sh", DELETE="1").stdout)
    assert "pkill -TERM" in stop[0][-1] and stop[1][4] == "delete"
    missing = subprocess.run(["bash", str(SCRIPTS / "create.sh")], capture_output=True, text=True,
                             env={k: v for k, v in (os.environ | ENV).items() if k != "BUCKET"})  # fmt: skip
    assert missing.returncode != 0 and "set BUCKET" in missing.stderr


def test_start_runs_the_controller_with_the_tpu_vm_preset():
    (ssh,) = _gcloud(_script("start.sh").stdout)
    assert ssh[ssh.index("--worker") + 1] == "0"
    remote = shlex.split(ssh[-1].split("&&", 1)[1].split(">", 1)[0])
    assert remote[:3] == ["nohup", ".venv/bin/python", "-m"] and remote[3] == "rlax_tpu.controller"
    flags = remote[4:]
    # The same flags, here: the config they name is valid and is the one-host preset.
    done = subprocess.run([sys.executable, "-m", "rlax_tpu.controller", *flags, "--print_config"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    assert config["preset"] == "tpu_vm" and config["controller"]["transport"] == "local"
    assert config["controller"]["run_dir"] == "gs://my-bucket/runs/codeforces-tpu-vm"
    # Where JAX sees no TPU the preset assumes an 8-chip host: 4 train, 4 generate.
    assert config["topology"]["trainer_devices"] == 4
    assert config["inference"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 4}


def test_start_refuses_a_multi_host_vm_for_now():
    done = _script("start.sh", ACCELERATOR="v5p-32")
    assert done.returncode == 2 and "not built yet" in done.stderr
