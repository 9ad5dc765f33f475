"""A run on Cloud TPU VMs: which VMs the config needs, and what each of their hosts runs.

    python -m rlax_tpu.launch.tpu_vm vms  --config=... [--name=rl]
    python -m rlax_tpu.launch.tpu_vm plan --config=... --trainer_ips=IP,IP --inference_ips='IP;IP'

``vms`` prints one line per TPU VM, "<name> <accelerator-type>": with the local transport (the
``tpu_vm`` preset) one VM runs everything in one process; with the distributed transport (the GKE
presets, e.g. ``codeforces.py:v5p_small``) the trainer's slice (topology.trainer_tpu) is one VM,
possibly of several hosts, and each inference worker's slice (topology.inference_tpu) another.

``plan`` prints one line per process, "<vm> <worker> <name> <shell command>", in start order: on
the trainer VM's worker 0 the parameter-server replicas, the verifier service (on loopback: only the
controller calls it) and, last, the controller; on every trainer worker a trainer process (one
jax.distributed job, coordinator on worker 0); on each inference VM its worker. Every other endpoint
listens on the VM's interfaces with TLS and the tokens under ``--secrets`` (make them with
``deploy/gke/make-credentials.sh DIR rlax IP...``: the certificate names the VMs' addresses). The
controller's step waits until every service answers its health probe. ``deploy/tpu_vm/start.sh``
runs the plan over ``gcloud compute tpus tpu-vm ssh``.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence
from typing import Literal

from rlax_tpu import storage
from rlax_tpu.cli import tuple_value
from rlax_tpu.config import RunConfig
from rlax_tpu.config.libtpu import ENV as LIBTPU_ENV
from rlax_tpu.config.libtpu import libtpu_init_args
from rlax_tpu.launch.slices import parse_slice, tpu_vm_accelerator

COORDINATOR_PORT = 8476
SECRETS = "/etc/rlax"
PROBE_WAIT_S = 3600  # weights from GCS and the first compiles, on the slowest host


class PlanError(ValueError):
    """The config and the VMs do not fit together; the message lists every problem."""


@dataclasses.dataclass(frozen=True)
class Process:
    vm: str
    worker: int
    name: str
    argv: tuple[str, ...]  # run in the repository on that host

    def shell(self) -> str:
        """The command line a host runs: in the background, its output in logs/<name>.log;
        the controller's probe step in the foreground."""
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        if self.name.startswith("wait-"):
            return f"cd rlax_tpu && {cmd}"
        return (
            f"cd rlax_tpu && mkdir -p logs && nohup {cmd} > logs/{self.name}.log 2>&1 < /dev/null &"
        )


def vms(config: RunConfig, name: str, *, one_vm: str = "v5litepod-8") -> list[tuple[str, str, int]]:
    """(VM name, accelerator type, hosts) of every TPU VM the run needs; a run in one process
    (local transport) takes one VM of accelerator ``one_vm`` (one host)."""
    t = config.topology
    if config.controller.transport == "local":
        return [(name, one_vm, 1)]
    if not t.trainer_tpu or not t.inference_tpu:
        raise PlanError("topology.trainer_tpu and topology.inference_tpu name the VMs' slices")
    if config.mesh.slices > 1:
        raise PlanError(
            f"mesh.slices = {config.mesh.slices}: the TPU VM scripts create one slice per trainer "
            "(multislice TPU VMs are a queued resource with --node-count, not yet planned "
            "here); run a multislice trainer on GKE (--render=gke)"
        )
    trainer, inference = parse_slice(t.trainer_tpu), parse_slice(t.inference_tpu)
    return [(name, tpu_vm_accelerator(trainer), trainer.hosts)] + [
        (f"{name}-inference-{i}", tpu_vm_accelerator(inference), inference.hosts)
        for i in range(config.inference.num_workers)
    ]


def plan(
    config: RunConfig,
    config_args: Sequence[str],
    *,
    name: str,
    trainer_ips: Sequence[str],
    inference_ips: Sequence[Sequence[str]],
    secrets: str = SECRETS,
) -> list[Process]:
    """Every process of the run, in start order (see the module docstring)."""
    args = list(config_args)
    py = (".venv/bin/python", "-m")
    if config.controller.transport == "local":
        # Root: its verifiers run untrusted code under their own sandbox uids. Its trainer and
        # workers share the process: the trainer's flags.
        tpu = tpu_env(config, "trainer")
        return [Process(name, 0, "controller", ("sudo", *tpu, *py, "rlax_tpu.controller", *args))]
    _check(config, trainer_ips, inference_ips)
    ports = {
        s: int(getattr(config, s).address.rpartition(":")[2])
        for s in ("param_server", "trainer", "inference", "verifiers")
    }
    lead = trainer_ips[0]
    creds = []
    for section in ("param_server", "trainer", "inference", "verifiers"):
        creds += [
            f"--config.{section}.auth_token_file={secrets}/token",
            f"--config.{section}.tls_cert_file={secrets}/tls.pem",
        ]
    creds += [
        f"--config.controller.auth_token_file={secrets}/token",
        f"--config.controller.tls_cert_file={secrets}/tls.pem",
        f"--config.param_server.publish_token_file={secrets}/publish-token",
    ]
    replicas = config.param_server.replicas
    ps_ports = replica_ports(ports, replicas)
    ps_endpoints = [f"{lead}:{port}" for port in ps_ports]
    wired = [
        *args,
        *creds,
        f"--config.controller.param_server_endpoints={tuple_value(ps_endpoints)}",
    ]
    out = [
        Process(
            name,
            0,
            f"param_server-{r}",
            (
                *py,
                "rlax_tpu.param_server",
                *wired,
                f"--config.param_server.address=0.0.0.0:{port}",
                f"--config.param_server.replica_index={r}",
            ),
        )
        for r, port in enumerate(ps_ports)
    ]
    verifier = f"127.0.0.1:{ports['verifiers']}"
    out.append(
        Process(
            name,
            0,
            "verifiers",
            ("sudo", *py, "rlax_tpu.verifiers", *wired, f"--config.verifiers.address={verifier}"),
        )
    )
    out += _group(name, "trainer", trainer_ips, ports["trainer"], wired, tpu_env(config, "trainer"))
    for i, ips in enumerate(inference_ips):
        out += _group(
            f"{name}-inference-{i}",
            "inference",
            ips,
            ports["inference"],
            [*wired, f"--config.inference.worker_index={i}"],
            tpu_env(config, "inference"),
        )
    workers = [f"{ips[0]}:{ports['inference']}" for ips in inference_ips]
    endpoints = {
        "trainer_endpoint": f"{lead}:{ports['trainer']}",
        "verifier_endpoint": verifier,
        "inference_endpoints": tuple_value(workers),
    }
    wait = [
        *(("ParamServer", p) for p in ps_endpoints),
        ("Verifier", verifier),
        ("Trainer", endpoints["trainer_endpoint"]),
        *(("Inference", w) for w in workers),
    ]
    for service, endpoint in wait:
        out.append(
            Process(
                name,
                0,
                f"wait-{service}-{endpoint}",
                (
                    *py,
                    "rlax_tpu.rpc.probe",
                    service,
                    endpoint,
                    f"--token_file={secrets}/token",
                    f"--tls_cert_file={secrets}/tls.pem",
                    f"--wait_s={PROBE_WAIT_S}",
                ),
            )
        )
    out.append(
        Process(
            name,
            0,
            "controller",
            (
                *py,
                "rlax_tpu.controller",
                *wired,
                "--config.controller.transport=distributed",
                *(f"--config.controller.{k}={v}" for k, v in endpoints.items()),
            ),
        )
    )
    return out


def replica_ports(ports: dict[str, int], replicas: int) -> list[int]:
    """The lead VM's ports of the parameter-server replicas: param_server's port and the next
    free ones after it, skipping the ports the trainer, the workers and the verifiers listen on
    (they share that host: replica r at port + r would land on the trainer's, 50053)."""
    taken = {port for section, port in ports.items() if section != "param_server"}
    taken.add(COORDINATOR_PORT)
    out, port = [], ports["param_server"]
    while len(out) < replicas:
        if port not in taken:
            out.append(port)
        port += 1
    return out


def tpu_env(config: RunConfig, component: Literal["trainer", "inference"]) -> tuple[str, ...]:
    """What a TPU process's command starts with: ``env LIBTPU_INIT_ARGS=...`` (the flags the
    AOT check compiles with, config/libtpu.py), or nothing when the config sets none."""
    flags = libtpu_init_args(config, component)
    return ("env", f"{LIBTPU_ENV}={flags}") if flags else ()


def _group(
    vm: str, section: str, ips: Sequence[str], port: int, args: list[str], env: tuple[str, ...]
) -> list[Process]:
    """One process per host of a VM (``env``: its command's prefix); several form one
    jax.distributed job."""
    base = [*args, f"--config.{section}.address=0.0.0.0:{port}"]
    if len(ips) == 1:
        return [
            Process(vm, 0, section, (*env, ".venv/bin/python", "-m", f"rlax_tpu.{section}", *base))
        ]
    return [
        Process(
            vm,
            w,
            f"{section}.{w}",
            (
                *env,
                ".venv/bin/python",
                "-m",
                f"rlax_tpu.{section}",
                *base,
                f"--config.{section}.distributed.coordinator_address={ips[0]}:{COORDINATOR_PORT}",
                f"--config.{section}.distributed.process_id={w}",
            ),
        )
        for w in range(len(ips))
    ]


def _check(
    config: RunConfig, trainer_ips: Sequence[str], inference_ips: Sequence[Sequence[str]]
) -> None:
    t, problems = config.topology, []
    trainer_hosts = parse_slice(t.trainer_tpu).hosts if t.trainer_tpu else 1
    if len(trainer_ips) != trainer_hosts:
        problems.append(
            f"the trainer's VM has {len(trainer_ips)} hosts, {t.trainer_tpu} has {trainer_hosts}"
        )
    if config.trainer.distributed.num_processes != trainer_hosts:
        problems.append(
            f"trainer.distributed.num_processes is "
            f"{config.trainer.distributed.num_processes}, {trainer_hosts} hosts"
        )
    if len(inference_ips) != config.inference.num_workers:
        problems.append(
            f"{len(inference_ips)} inference VMs for inference.num_workers "
            f"{config.inference.num_workers}"
        )
    hosts = parse_slice(t.inference_tpu).hosts if t.inference_tpu else 1
    for i, ips in enumerate(inference_ips):
        if len(ips) != hosts:
            problems.append(f"inference VM {i} has {len(ips)} hosts, {t.inference_tpu} has {hosts}")
    if not storage.is_remote(config.controller.run_dir):
        problems.append("controller.run_dir must be on GCS: the VMs share it")
    if config.controller.warmup_steps:
        problems.append("controller.warmup_steps must be 0 (services start from the weights)")
    if problems:
        raise PlanError("the config does not fit the TPU VMs:\n  - " + "\n  - ".join(problems))


def run(config: RunConfig, args: list[str]) -> int:
    from absl import flags

    from rlax_tpu import cli

    f = flags.FLAGS
    if args not in (["vms"], ["plan"]):
        print("rlax_tpu.launch.tpu_vm: give one command, vms or plan", file=sys.stderr)
        return cli.EXIT_USAGE
    config_args = cli.config_args(sys.argv[1:])
    try:
        if args == ["vms"]:
            for vm, accelerator, hosts in vms(config, f.name, one_vm=f.accelerator):
                print(vm, accelerator, hosts)
            return 0
        trainer_ips = [ip for ip in f.trainer_ips.split(",") if ip]
        inference_ips = [
            [ip for ip in vm.split(",") if ip] for vm in f.inference_ips.split(";") if vm
        ]
        for p in plan(
            config,
            config_args,
            name=f.name,
            trainer_ips=trainer_ips,
            inference_ips=inference_ips,
            secrets=f.secrets,
        ):
            print(p.vm, p.worker, p.name, p.shell())
    except PlanError as e:
        print(f"rlax_tpu.launch.tpu_vm: error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    return 0


if __name__ == "__main__":
    from absl import flags

    from rlax_tpu import cli

    flags.DEFINE_string("name", "rlax", "The TPU VMs' name (inference VMs get -inference-<i>).")
    flags.DEFINE_string(
        "trainer_ips", "", "plan: the trainer VM's hosts' internal IPs, worker order."
    )
    flags.DEFINE_string("inference_ips", "", "plan: each inference VM's hosts' IPs ('a,b;c,d').")
    flags.DEFINE_string("accelerator", "v5litepod-8", "vms: the one VM of a one-process run.")
    flags.DEFINE_string(
        "secrets", SECRETS, "plan: the folder holding token, publish-token, tls.pem."
    )
    cli.main("launch.tpu_vm", run)
