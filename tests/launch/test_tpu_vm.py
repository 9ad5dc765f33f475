"""deploy/tpu_vm and its plan (rlax_tpu.launch.tpu_vm): the commands the scripts run (DRY_RUN=1
prints them) and that every process they start gets a valid config wired to the others."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlax_tpu.config import RunConfig, from_dict
from rlax_tpu.config.libtpu import libtpu_init_args

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "deploy" / "tpu_vm"
ENV = {
    "NAME": "rl",
    "ZONE": "us-east5-a",
    "BUCKET": "gs://my-bucket",
    "DRY_RUN": "1",
    "REPO_URL": "https://example.com/rlax_tpu.git",
}
POD = {"CONFIG": "configs/codeforces.py:v5p_small"}


def _script(name: str, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", str(SCRIPTS / name)],
        env=os.environ | ENV | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done


def _gcloud(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ gcloud")]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_create_makes_one_vm_per_slice():
    one = _gcloud(_script("create.sh", ACCELERATOR="v6e-8", SPOT="1").stdout)
    assert [(c[5], _flag(c, "--accelerator-type"), _flag(c, "--version")) for c in one] == [
        ("rl", "v6e-8", "v2-alpha-tpuv6e")
    ]
    assert "--spot" in one[0]
    pod = _gcloud(_script("create.sh", **POD).stdout)
    assert [(c[5], _flag(c, "--accelerator-type")) for c in pod] == [
        ("rl", "v5p-16"),
        ("rl-inference-0", "v5p-8"),
        ("rl-inference-1", "v5p-8"),
    ]


def test_setup_installs_everywhere_and_certifies_every_address():
    done = _script("setup.sh", **POD)
    assert done.returncode == 0, done.stderr
    calls = _gcloud(done.stdout)
    installs = [c for c in calls if "make setup" in c[-1]]
    assert [(c[4 + 1], _flag(c, "--worker")) for c in installs] == [
        ("rl", "all"),
        ("rl-inference-0", "all"),
        ("rl-inference-1", "all"),
    ]
    (make,) = [shlex.split(x[2:]) for x in done.stdout.splitlines() if "make-credentials" in x]
    addresses = make[4:]
    assert addresses[0] == "127.0.0.1" and len(addresses) == 1 + 2 + 1 + 1  # 2 trainer hosts
    copies = [c for c in calls if c[4] == "scp"]
    assert len(copies) == 3 and all(_flag(c, "--worker") == "all" for c in copies)
    missing = _script("setup.sh", REPO_URL="")
    assert missing.returncode != 0 and "set REPO_URL" in missing.stderr


def test_start_on_one_vm_runs_the_controller_with_the_tpu_vm_preset():
    (ssh,) = _gcloud(_script("start.sh").stdout)
    assert _flag(ssh, "--worker") == "0"
    remote = shlex.split(ssh[-1].split("nohup", 1)[1].split(">", 1)[0])
    # On the TPU: the XLA flags the AOT check compiles with (config/libtpu.py).
    assert remote[:3] == ["sudo", "env", f"LIBTPU_INIT_ARGS={DENSE_FLAGS}"]
    assert remote[3:6] == [".venv/bin/python", "-m", "rlax_tpu.controller"]
    config = _print_config("controller", remote[6:])
    assert config["preset"] == "tpu_vm" and config["controller"]["transport"] == "local"
    assert config["controller"]["run_dir"] == "gs://my-bucket/runs/codeforces-tpu-vm"
    # Where JAX sees no TPU the preset assumes an 8-chip host: 4 train, 4 generate.
    assert config["topology"]["trainer_devices"] == 4
    assert config["inference"]["mesh"] == {
        "data": 1,
        "fsdp": 1,
        "tensor": 4,
        "slices": 1,
        "expert": 1,
    }


def _print_config(module: str, flags: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", f"rlax_tpu.{module}", *flags, "--print_config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _processes(stdout: str) -> list[tuple[str, str, list[str]]]:
    """(vm, worker, argv) of every python process start.sh starts, in order (its ``sudo`` and
    ``env VAR=...`` prefixes dropped: ``ENVS`` keeps the env of each (vm, worker, module))."""
    out = []
    for call in _gcloud(stdout):
        command = call[-1].split("&&")[-1]
        command = command.split(">", 1)[0].replace("nohup", "")
        argv = shlex.split(command)
        if argv[0] == "sudo":
            argv = argv[1:]
        env = {}
        if argv[0] == "env":
            argv = argv[1:]
            while "=" in argv[0] and not argv[0].startswith("-"):
                key, _, value = argv.pop(0).partition("=")
                env[key] = value
        ENVS[(call[5], _flag(call, "--worker"), argv[2])] = env
        out.append((call[5], _flag(call, "--worker"), argv))
    return out


ENVS: dict[tuple[str, str, str], dict[str, str]] = {}
DENSE_FLAGS = libtpu_init_args(from_dict(RunConfig, {}), "trainer")
INFERENCE_FLAGS = libtpu_init_args(from_dict(RunConfig, {}), "inference")


@pytest.fixture(scope="module")
def pod_plan() -> list[tuple[str, str, list[str]]]:
    done = _script("start.sh", **POD)
    assert done.returncode == 0, done.stderr
    return _processes(done.stdout)


def test_start_on_several_vms_starts_every_component_in_order(pod_plan):
    modules = [(vm, w, argv[2]) for vm, w, argv in pod_plan]
    assert modules[:6] == [
        ("rl", "0", "rlax_tpu.param_server"),
        ("rl", "0", "rlax_tpu.verifiers"),
        ("rl", "0", "rlax_tpu.trainer"),
        ("rl", "1", "rlax_tpu.trainer"),
        ("rl-inference-0", "0", "rlax_tpu.inference"),
        ("rl-inference-1", "0", "rlax_tpu.inference"),
    ]
    probes = [argv[3] for _, _, argv in pod_plan if argv[2] == "rlax_tpu.rpc.probe"]
    assert probes == ["ParamServer", "Verifier", "Trainer", "Inference", "Inference"]
    assert modules[-1] == ("rl", "0", "rlax_tpu.controller")


def test_the_tpu_processes_start_with_the_xla_flags_the_aot_check_compiles_with(pod_plan):
    """config/libtpu.py's LIBTPU_INIT_ARGS on every trainer and inference process (those on
    the TPUs), on no other."""
    on_tpu = {"rlax_tpu.trainer": DENSE_FLAGS, "rlax_tpu.inference": INFERENCE_FLAGS}
    for vm, worker, argv in pod_plan:
        env = ENVS[(vm, worker, argv[2])]
        flags = on_tpu.get(argv[2])
        assert env == ({"LIBTPU_INIT_ARGS": flags} if flags else {}), argv[2]
    assert "--xla_tpu_overlap_compute_collective_tc=true" in DENSE_FLAGS


def test_the_pod_plan_wires_each_process_to_the_others(pod_plan):
    configs = {}
    for vm, worker, argv in pod_plan:
        if argv[2] == "rlax_tpu.rpc.probe":
            continue
        module = argv[2].removeprefix("rlax_tpu.")
        configs[(vm, worker, module)] = _print_config(module, argv[3:])
    controller = configs[("rl", "0", "controller")]["controller"]
    trainer0, trainer1 = configs[("rl", "0", "trainer")], configs[("rl", "1", "trainer")]
    lead = controller["trainer_endpoint"].rpartition(":")[0]
    # The trainer: one jax.distributed job over the VM's two hosts, coordinator on worker 0.
    assert trainer0["trainer"]["distributed"] | {"process_id": 0} == trainer1["trainer"][
        "distributed"
    ] | {"process_id": 0}
    assert trainer1["trainer"]["distributed"]["process_id"] == 1
    assert trainer0["trainer"]["distributed"]["coordinator_address"] == f"{lead}:8476"
    # Every endpoint the controller dials is where a process listens: worker 0 of the trainer's
    # VM for the parameter server and the trainer, loopback for the verifiers (the controller's
    # own host), worker 0 of each inference VM for the workers.
    ps = configs[("rl", "0", "param_server")]["param_server"]
    assert controller["param_server_endpoints"] == [f"{lead}:{ps['address'].rpartition(':')[2]}"]
    assert trainer0["trainer"]["address"] == f"0.0.0.0:{controller['trainer_endpoint'][-5:]}"
    hosts = [e.rpartition(":")[0] for e in controller["inference_endpoints"]]
    assert len(set(hosts + [lead])) == 3  # each worker on its own VM
    for cfg in configs.values():  # TLS and the token everywhere; publish token where set
        assert cfg["controller"]["tls_cert_file"] == "/etc/rlax/tls.pem"
        for section in ("param_server", "trainer", "inference", "verifiers"):
            assert cfg[section]["auth_token_file"] == "/etc/rlax/token"
    workers = [configs[(f"rl-inference-{i}", "0", "inference")]["inference"] for i in (0, 1)]
    assert [w["worker_index"] for w in workers] == [0, 1]
    assert controller["inference_endpoints"][0].endswith(":50051")
    assert controller["verifier_endpoint"] == "127.0.0.1:50054"
    assert configs[("rl", "0", "verifiers")]["verifiers"]["address"] == "127.0.0.1:50054"


def test_a_config_that_does_not_fit_the_vms_is_refused():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_tpu.launch.tpu_vm",
            "plan",
            "--config=configs/codeforces.py:v5p_small",
            "--config.controller.bucket=gs://b",
            "--trainer_ips=10.0.0.2",
            "--inference_ips=10.0.1.2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "the trainer's VM has 1 hosts, v5p:2x2x2 has 2" in done.stderr
    assert "1 inference VMs for inference.num_workers 2" in done.stderr


def test_a_multislice_trainer_is_refused_with_the_way_to_run_it():
    from rlax_tpu.launch.tpu_vm import PlanError, vms
    from tests.launch.test_gke import _config

    config = _config(
        ["--config=configs/codeforces.py:v5p_small", "--config.controller.bucket=gs://b"]
        + ["--config.mesh.slices=2"]
    )
    with pytest.raises(PlanError, match=r"mesh.slices = 2: .*run a multislice trainer on GKE"):
        vms(config, "rl")


def _remote(done: subprocess.CompletedProcess[str], marker: str) -> list[str]:
    return [c[-1] for c in _gcloud(done.stdout) if marker in c[-1]]


def test_setup_installs_and_uses_a_python_the_project_supports(tmp_path):
    """Cloud TPU VM images are Ubuntu 22.04 (https://cloud.google.com/tpu/docs/runtimes:
    tpu-ubuntu2204-base, v2-alpha-tpuv5...), whose python3 is 3.10, below pyproject's 3.11:
    setup.sh installs python3.11 before `make setup`, and the Makefile makes the venv with the
    newest Python >= 3.11 on PATH, refusing with the fix where there is none."""
    install = _remote(_script("setup.sh"), "make setup")[0]
    assert install.index("apt-get install -y -qq python3.11 python3.11-venv") < install.index(
        "sudo make setup"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    image_python = bin_dir / "python3"  # the image's: 3.10
    image_python.write_text("#!/bin/sh\necho 'Python 3.10.12'; exit 1\n")
    image_python.chmod(0o755)
    make = ["/usr/bin/make", "-s", "-C", str(REPO), "python"]
    refused = subprocess.run(make, env={"PATH": str(bin_dir)}, capture_output=True, text=True)
    assert refused.returncode != 0
    assert "needs Python >= 3.11 on PATH (python3 is Python 3.10.12)" in refused.stderr
    assert "apt-get install python3.11 python3.11-venv" in refused.stderr
    (bin_dir / "python3.11").symlink_to(Path(sys.executable).resolve())  # after setup.sh's apt
    chosen = subprocess.run(make, env={"PATH": str(bin_dir)}, capture_output=True, text=True)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.startswith("python3.11 (Python 3.11.")


def test_credentials_are_readable_by_root_and_the_login_group_only():
    installs = _remote(_script("setup.sh", **POD), "/etc/rlax")
    assert len(installs) == 3  # every VM
    for install in installs:
        assert "install -d -m 0750" in install and "install -m 0640" in install
        assert "0644" not in install and "0755" not in install


def test_stop_reaches_every_vm_and_does_not_kill_its_own_shell(tmp_path):
    """stop.sh's remote command SIGTERMs the run's processes and exits 0: `pkill -f` matches
    command lines, and a plain pattern also matches the shell that runs it (exit 143, and the
    script stopped before the other VMs). Run here with the process name made unique, so the
    test stops nothing else."""
    done = _script("stop.sh", **POD)
    assert done.returncode == 0, done.stderr
    calls = [c for c in _gcloud(done.stdout) if c[4] == "ssh"]
    assert [(c[5], _flag(c, "--worker")) for c in calls] == [
        ("rl", "all"),
        ("rl-inference-0", "all"),
        ("rl-inference-1", "all"),
    ]
    command = calls[0][-1]
    assert command.startswith("sudo ")
    unique = f"rlax_tpu_stoptest_{os.getpid()}"
    local = command.removeprefix("sudo ").replace("rlax_tpu", unique)
    victim = subprocess.Popen(["bash", "-c", f"exec -a 'python -m {unique}.controller' sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while unique not in Path(f"/proc/{victim.pid}/cmdline").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stopped = subprocess.run(["bash", "-c", local], capture_output=True, timeout=30)
        assert stopped.returncode == 0  # not 143: the shell survived its own pkill
        assert victim.wait(timeout=10) == -15  # SIGTERM
    finally:
        victim.kill()


def test_parameter_server_replicas_get_ports_of_their_own():
    """Every replica listens on the lead VM beside the trainer and the verifiers: replica r at
    param_server's port + r would take the trainer's (50053) and the verifiers' (50054)."""
    three = "--config.controller.param_server_endpoints=('a:1','b:2','c:3',)"
    done = _script("start.sh", **POD, EXTRA_FLAGS=f"--config.param_server.replicas=3 {three}")
    assert done.returncode == 0, done.stderr
    listening = []
    for vm, worker, argv in _processes(done.stdout):
        for arg in argv:
            if arg.startswith("--config.") and ".address=" in arg and arg.count(":") == 1:
                listening.append((vm, worker, arg.rpartition(":")[2]))
    lead = [port for vm, worker, port in listening if (vm, worker) == ("rl", "0")]
    assert len(lead) == len(set(lead)) == 3 + 2  # 3 replicas, the trainer, the verifiers
    assert "8476" not in lead  # jax.distributed's coordinator
