"""Checks a built GKE deployment offline: schemas, and that it deploys what the config describes.

    python -m rlax_tpu.launch.validate --config=... [--config.a.b=v ...] DIR

builds the kustomize overlay DIR (the pinned ``kustomize`` binary), validates every core object
against its Kubernetes schema (``kubernetes-validate``, strict: unknown fields are errors), the
JobSet against ``deploy/gke/schemas/jobset-v1alpha2.json`` and each of its job templates as a
batch/v1 Job, then checks consistency with the config: each endpoint the controller dials has its
Service on the right port, selecting a pod that exists and listens there; replica, host and chip
counts match the topology; the slices match the meshes; the NetworkPolicies allow exactly the
edges of ``gke.EDGES`` (plus each multi-process job to itself), nothing else, and nothing out of
the verifiers; restarts follow the design (:func:`restart_problems`: a single-host job replaces
its own pods and a drained one does not count, a multi-host job fails whole and a disruption
restarts the JobSet without spending its budget, in the order JobSet evaluates its rules); every
pod requests CPU and memory that fit its node (:func:`resource_problems`); every pod but the
verifiers' (root) runs as the image's non-root user and pulls the config's image from a registry
(:func:`security_problems`). Exit status 0 when all holds, 1 with every problem listed.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlax_tpu.config import RunConfig
from rlax_tpu.launch import gke
from rlax_tpu.launch.slices import GiB, gke_accelerator, parse_slice, schedulable, tpu_vm

REPO = Path(__file__).resolve().parents[2]
JOBSET_SCHEMA = REPO / "deploy" / "gke" / "schemas" / "jobset-v1alpha2.json"
KUBERNETES_VERSION = "1.33.0"  # GKE's regular channel in 2026-11 (JobSet >= 0.8 needs >= 1.29)


def kustomize_binary() -> str:
    """The pinned kustomize (`make setup` puts it next to the venv's python)."""
    beside = Path(sys.executable).parent / "kustomize"
    found = str(beside) if beside.exists() else shutil.which("kustomize")
    if not found:
        raise FileNotFoundError("kustomize is not installed; `make setup` installs the pinned one")
    return found


def setup_objects(overlay: Path) -> list[dict[str, Any]]:
    """The set-up objects beside the overlay (its namespace; not part of the kustomization)."""
    path = overlay / gke.SETUP_FILE
    return [o for o in yaml.safe_load_all(path.read_text()) if o] if path.exists() else []


def build(overlay: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build overlay`` renders (what ``kubectl apply -k`` creates and
    ``kubectl delete -k`` deletes)."""
    done = subprocess.run(
        [kustomize_binary(), "build", str(overlay)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise ValueError(f"kustomize build {overlay} failed: {done.stderr.strip()}")
    return [o for o in yaml.safe_load_all(done.stdout) if o]


def schema_problems(objects: Iterable[dict[str, Any]]) -> list[str]:
    """Every schema violation, as '<kind>/<name>: <message>'."""
    import jsonschema
    import kubernetes_validate

    jobset_schema = json.loads(JOBSET_SCHEMA.read_text())
    problems = []

    def core(obj: dict[str, Any], where: str) -> None:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            problems.append(f"{where}: {path}: {e.message}")

    for obj in objects:
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if obj.get("kind") == "JobSet":
            for err in jsonschema.Draft202012Validator(jobset_schema).iter_errors(obj):
                problems.append(f"{where}: {'/'.join(map(str, err.path))}: {err.message}")
            for rjob in obj.get("spec", {}).get("replicatedJobs", []):
                template = rjob.get("template", {})
                job = {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {
                        "name": rjob.get("name", "job"),
                        **(template.get("metadata") or {}),
                    },
                    "spec": template.get("spec", {}),
                }
                core(job, f"{where} replicatedJob {rjob.get('name')}")
        else:
            core(obj, where)
    return problems


def _by_kind(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o.get("kind") == kind}


def consistency_problems(config: RunConfig, objects: Sequence[dict[str, Any]]) -> list[str]:
    """Every way the built objects differ from what ``config`` describes."""
    t = config.topology
    problems: list[str] = []
    for o in objects:
        ns = o["metadata"].get("namespace")
        if o["kind"] != "Namespace" and ns != t.namespace:
            problems.append(
                f"{o['kind']}/{o['metadata']['name']} is in namespace {ns!r}, not {t.namespace!r}"
            )
    jobsets = list(_by_kind(objects, "JobSet").values())
    if len(jobsets) != 1:
        return [*problems, f"expected one JobSet, found {len(jobsets)}"]
    rjobs = {r["name"]: r for r in jobsets[0]["spec"]["replicatedJobs"]}
    services = _by_kind(objects, "Service")

    # Endpoints -> Services -> pods.
    cc = config.controller
    dialed = [
        *cc.param_server_endpoints,
        cc.verifier_endpoint,
        cc.trainer_endpoint,
        *cc.inference_endpoints,
    ]
    for endpoint in dialed:
        host, _, port = endpoint.rpartition(":")
        name, _, rest = host.partition(".")
        if rest not in (f"{t.namespace}.svc", f"{t.namespace}.svc.cluster.local"):
            problems.append(f"endpoint {endpoint} is not a Service of namespace {t.namespace}")
            continue
        svc = services.get(name)
        if svc is None:
            problems.append(f"endpoint {endpoint} has no Service {name!r}")
            continue
        ports = [p["port"] for p in svc["spec"]["ports"]]
        if int(port) not in ports:
            problems.append(f"Service {name} exposes {ports}, the controller dials {port}")
        problems += _selector_problems(svc, rjobs, int(port))
    for name in services:
        if not any(e.rpartition(":")[0].split(".")[0] == name for e in dialed):
            problems.append(f"Service {name} is not an endpoint of the config")

    # Counts, slices and meshes.
    want_replicas = {
        "param-server": config.param_server.replicas,
        "trainer": gke.slice_count(config, "trainer"),  # a job per slice
        "inference": config.inference.num_workers,
        "verifiers": t.verifier_replicas,
        "controller": 1,
    }
    for name, want in want_replicas.items():
        got = rjobs.get(name, {}).get("replicas")
        if got != want:
            problems.append(f"replicatedJob {name} has {got} replicas, the config {want}")
    for name, tpu, section in (
        ("trainer", t.trainer_tpu, config.trainer),
        ("inference", t.inference_tpu, config.inference),
    ):
        if name not in rjobs:
            continue
        spec = rjobs[name]["template"]["spec"]
        pod = spec["template"]["spec"]
        hosts = parse_slice(tpu).hosts if tpu else 1
        if spec["parallelism"] != hosts or spec["completions"] != hosts:
            problems.append(f"{name} runs {spec['parallelism']} pods, its slice has {hosts} hosts")
        every_slice = hosts * gke.slice_count(config, name)
        if section.distributed.num_processes != every_slice:
            problems.append(
                f"{name}.distributed.num_processes {section.distributed.num_processes}"
                f" != {every_slice} hosts"
            )
        selector = pod.get("nodeSelector", {})
        if tpu:
            s = parse_slice(tpu)
            want = {
                "cloud.google.com/gke-tpu-topology": s.topology,
                "cloud.google.com/gke-tpu-accelerator": gke_accelerator(s),
            }
            if {k: selector.get(k) for k in want} != want:
                problems.append(f"{name}'s node selector {selector} is not {s.name}")
            chips = pod["containers"][0]["resources"]["limits"].get("google.com/tpu")
            if chips != str(s.chips_per_host):
                problems.append(
                    f"{name} asks for {chips} chips per pod, a {s.name} host has {s.chips_per_host}"
                )
            mesh = config.mesh if name == "trainer" else config.inference.mesh
            problems += gke.mesh_problems(mesh, s, name)
    accounts = _by_kind(objects, "ServiceAccount")
    for name, r in rjobs.items():
        account = r["template"]["spec"]["template"]["spec"].get("serviceAccountName")
        if account and account not in accounts:
            problems.append(
                f"replicatedJob {name} runs as ServiceAccount {account!r}, not deployed"
            )
    problems += network_problems(config, objects)
    problems += security_problems(config, objects)
    problems += restart_problems(config, objects)
    problems += resource_problems(config, objects)
    return problems


def _first_rule_action(rules: list[dict[str, Any]], reason: str, rjob: str) -> str:
    """The action JobSet takes when ``rjob`` fails with ``reason``: "the rules will be evaluated
    in order, and only the first matching rule will be executed. If no matching rule is found,
    the RestartJobSet action is applied" (jobset_types.go). An empty list matches all."""
    for rule in rules:
        reasons, targets = rule.get("onJobFailureReasons"), rule.get("targetReplicatedJobs")
        if (not reasons or reason in reasons) and (not targets or rjob in targets):
            return rule["action"]
    return "RestartJobSet"


def _on_disruption(job_spec: dict[str, Any]) -> str | None:
    """The podFailurePolicy action for a pod with the DisruptionTarget condition (the first
    matching rule; Kubernetes evaluates them in order), None when no rule matches."""
    for rule in (job_spec.get("podFailurePolicy") or {}).get("rules", []):
        for c in rule.get("onPodConditions") or []:
            if c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True":
                return rule["action"]
    return None


def restart_problems(config: RunConfig, objects: Sequence[dict[str, Any]]) -> list[str]:
    """Every way the JobSet's failure handling differs from the design (gke.py's docstring)."""
    spec = _jobset(objects)["spec"]
    rules = (spec.get("failurePolicy") or {}).get("rules", [])
    rjobs = {r["name"]: r for r in spec["replicatedJobs"]}
    problems = [
        f"failurePolicy rule {rule.get('name')} targets replicatedJob {name!r}, which is absent"
        for rule in rules
        for name in rule.get("targetReplicatedJobs") or []
        if name not in rjobs
    ]
    for name, rjob in rjobs.items():
        job = rjob["template"]["spec"]
        restart = job["template"]["spec"].get("restartPolicy")
        if job.get("podFailurePolicy") is not None and restart != "Never":
            # batch/v1 JobSpec.podFailurePolicy: "This field cannot be used in combination with
            # restartPolicy=OnFailure" (and a Job's pods allow only OnFailure or Never).
            problems.append(
                f"replicatedJob {name} has a podFailurePolicy, so its pods' restartPolicy must "
                f"be Never, not {restart!r}"
            )
        backoff = job.get("backoffLimit", 6)  # batch/v1's default
        action = _on_disruption(job)
        if job.get("parallelism", 1) > 1:
            if backoff != 0:
                problems.append(
                    f"replicatedJob {name} is one jax.distributed job over "
                    f"{job['parallelism']} pods: backoffLimit must be 0 (a replaced pod cannot "
                    f"rejoin its job; the JobSet restarts it whole), got {backoff}"
                )
            if action != "FailJob":
                problems.append(
                    f"replicatedJob {name}: a drained or preempted pod must fail the whole job "
                    f"(podFailurePolicy FailJob on DisruptionTarget), got {action}"
                )
            else:
                first = _first_rule_action(rules, "PodFailurePolicy", name)
                if first != "RestartJobSetAndIgnoreMaxRestarts":
                    problems.append(
                        f"the first failurePolicy rule matching {name} failed by its "
                        f"podFailurePolicy (a disrupted host) is {first}, not "
                        "RestartJobSetAndIgnoreMaxRestarts: a preemption would spend "
                        "topology.max_restarts (put that rule before the others)"
                    )
        else:
            if action != "Ignore":
                problems.append(
                    f"replicatedJob {name}: a drained or preempted pod of a single-host job must "
                    f"be replaced without counting (podFailurePolicy Ignore on "
                    f"DisruptionTarget), got {action}"
                )
            if backoff != config.topology.pod_restarts:
                problems.append(
                    f"replicatedJob {name} replaces {backoff} failed pods, "
                    f"topology.pod_restarts is {config.topology.pod_restarts}"
                )
        first = _first_rule_action(rules, "BackoffLimitExceeded", name)
        if first != "RestartJobSet":
            problems.append(
                f"the first failurePolicy rule matching a failed {name} (BackoffLimitExceeded) "
                f"is {first}: a failure must restart the run and spend one of "
                "topology.max_restarts"
            )
    return problems


def security_problems(config: RunConfig, objects: Sequence[dict[str, Any]]) -> list[str]:
    """Pods that would run as the wrong user or pull an image no node can: every pod but the
    verifiers' runs as the image's non-root user (uid and group gke.RUN_AS_UID, runAsNonRoot, the
    group owning its volumes); the verifiers' run as root (bubblewrap, per-slot uids); every
    container runs the config's image from a registry."""
    want_image = gke.pod_image(config)
    problems = []
    for rjob in _jobset(objects)["spec"]["replicatedJobs"]:
        name = rjob["name"]
        pod = rjob["template"]["spec"]["template"]["spec"]
        pod_sc = pod.get("securityContext") or {}
        for c in pod["containers"]:
            sc = {**pod_sc, **(c.get("securityContext") or {})}  # the container's wins
            if c.get("image") != want_image:
                problems.append(f"{name} runs image {c.get('image')!r}, the config {want_image!r}")
            host = gke.registry_host(c.get("image", ""))
            if not host or host == "localhost":
                problems.append(
                    f"{name} runs image {c.get('image')!r}, which no GKE node can pull "
                    "(no registry): set topology.registry"
                )
            if name in gke.ROOT:
                if sc.get("runAsUser") != 0 or sc.get("runAsGroup") != 0:
                    problems.append(
                        f"{name} must run as root (uid and group 0) for the sandbox, runs as "
                        f"{sc.get('runAsUser')}:{sc.get('runAsGroup')}"
                    )
                continue
            if sc.get("runAsUser") in (None, 0) or sc.get("runAsNonRoot") is not True:
                problems.append(
                    f"{name} must run as the image's non-root user (runAsUser "
                    f"{gke.RUN_AS_UID}, runAsNonRoot), got runAsUser={sc.get('runAsUser')} "
                    f"runAsNonRoot={sc.get('runAsNonRoot')}"
                )
            if pod_sc.get("fsGroup") is None or sc.get("runAsGroup") in (None, 0):
                problems.append(
                    f"{name} needs a non-root runAsGroup and an fsGroup: its uid must read the "
                    f"Secret's files (mode 0440), got {pod_sc}"
                )
    return problems


_QUANTITY = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_QUANTITY |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "16", "8Gi", "1G") as a number."""
    text = str(value)
    for suffix in sorted(_QUANTITY, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _QUANTITY[suffix]
    return float(text)


def resource_problems(config: RunConfig, objects: Sequence[dict[str, Any]]) -> list[str]:
    """Pods that request no CPU or memory (BestEffort: the first evicted under memory
    pressure), or more than their node leaves to pods: a TPU VM (slices.TPU_VMS) for TPU pods,
    the CPU node pool's machine (topology.cpu_node_*) for the others."""
    t = config.topology
    slices = {"trainer": t.trainer_tpu, "inference": t.inference_tpu}
    problems = []
    for rjob in _jobset(objects)["spec"]["replicatedJobs"]:
        name = rjob["name"]
        container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
        requests = (container.get("resources") or {}).get("requests") or {}
        if "cpu" not in requests or "memory" not in requests:
            problems.append(f"{name} pods request no CPU or no memory: {requests}")
            continue
        machine = tpu_vm(parse_slice(slices[name])) if slices.get(name) else gke.cpu_node(config)
        cpus, memory = schedulable(machine)
        cpu, mem = quantity(requests["cpu"]), quantity(requests["memory"])
        if cpu > cpus or mem > memory:
            hint = (
                " (more topology.verifier_replicas with fewer verifiers.workers each)"
                if name == "verifiers"
                else ""
            )
            problems.append(
                f"{name} pods request {requests['cpu']} CPUs and {requests['memory']}, more "
                f"than a {machine.name} node ({machine.vcpus} vCPUs, {machine.memory_gb} GB) "
                f"leaves to pods: {cpus:.1f} CPUs, {memory / GiB:.1f} GiB{hint}"
            )
    return problems


def _selector_problems(svc: dict[str, Any], rjobs: dict[str, Any], port: int) -> list[str]:
    sel = svc["spec"]["selector"]
    name = svc["metadata"]["name"]
    rjob = rjobs.get(sel.get(gke.L_RJOB, ""))
    if rjob is None:
        return [f"Service {name} selects replicatedJob {sel.get(gke.L_RJOB)!r}, which is absent"]
    problems = []
    if gke.L_JOB_INDEX in sel and int(sel[gke.L_JOB_INDEX]) >= rjob["replicas"]:
        problems.append(f"Service {name} selects job {sel[gke.L_JOB_INDEX]} of {rjob['replicas']}")
    if (
        gke.L_POD_INDEX in sel
        and int(sel[gke.L_POD_INDEX]) >= rjob["template"]["spec"]["parallelism"]
    ):
        problems.append(f"Service {name} selects a pod index its job does not have")
    container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
    listening = [p["containerPort"] for p in container.get("ports", [])]
    if port not in listening:
        problems.append(f"Service {name}'s port {port} is not a port of {rjob['name']} {listening}")
    for p in svc["spec"]["ports"]:
        if p.get("targetPort", p["port"]) != p["port"]:
            problems.append(f"Service {name} maps {p['port']} to {p['targetPort']}")
    return problems


def allowed_edges(config: RunConfig, objects: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
    """(source, destination) component pairs the NetworkPolicies let connect on a port the
    destination listens on: the source's egress allows it and the destination's ingress allows
    the source (a component that no policy selects for a direction is open in it; one that is
    selected allows only its rules). An ipBlock peer counts as every pod (pod addresses are
    inside 0.0.0.0/0, and implementations match them)."""
    policies = list(_by_kind(objects, "NetworkPolicy").values())
    components = [*gke.COMPONENTS, "controller"]
    rjobs = {r["name"]: r for r in _jobset(objects)["spec"]["replicatedJobs"]}

    def listens(component: str) -> list[int]:
        pod = rjobs[component]["template"]["spec"]["template"]["spec"]
        return [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]

    def selects(selector: dict[str, Any], component: str) -> bool:
        labels = {gke.L_JOBSET: config.topology.name, gke.L_RJOB: component}
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    def rules(component: str, direction: str) -> list[dict[str, Any]] | None:
        mine = [
            p
            for p in policies
            if selects(p["spec"]["podSelector"], component)
            and direction.capitalize() in p["spec"].get("policyTypes", [])
        ]
        return None if not mine else [r for p in mine for r in p["spec"].get(direction, [])]

    def admits(rule_list: list[dict[str, Any]] | None, peer: str, key: str, port: int) -> bool:
        if rule_list is None:
            return True
        for rule in rule_list:
            peers = rule.get(key)
            ports = rule.get("ports")
            peer_ok = peers is None or any(
                "ipBlock" in p or ("podSelector" in p and selects(p["podSelector"], peer))
                for p in peers
            )
            if peer_ok and (ports is None or any(p.get("port") == port for p in ports)):
                return True
        return False

    edges = set()
    for src in components:
        for dst in components:
            if dst not in rjobs:
                continue
            for port in listens(dst):
                if admits(rules(src, "egress"), dst, "to", port) and admits(
                    rules(dst, "ingress"), src, "from", port
                ):
                    edges.add((src, dst))
    return edges


def _jobset(objects: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objects if o.get("kind") == "JobSet")


def network_problems(config: RunConfig, objects: Sequence[dict[str, Any]]) -> list[str]:
    want = set(gke.EDGES) | {(c, c) for c in gke.PEERS}
    got = allowed_edges(config, objects)
    problems = [
        f"NetworkPolicies allow {s} -> {d}, which the design forbids" for s, d in sorted(got - want)
    ]
    problems += [
        f"NetworkPolicies block {s} -> {d}, which the run needs" for s, d in sorted(want - got)
    ]
    for policy in _by_kind(objects, "NetworkPolicy").values():
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        component = selector.get(gke.L_RJOB)
        egress = policy["spec"].get("egress", [])
        if component == "verifiers" and egress:
            problems.append(f"NetworkPolicy {policy['metadata']['name']} lets verifiers out")
        if component in gke.GCS_CLIENTS:
            for cidr, port in gke.METADATA_SERVER_EGRESS:
                if not any(_admits_ip(rule, cidr, port) for rule in egress):
                    problems.append(
                        f"NetworkPolicy {policy['metadata']['name']} blocks the GKE metadata "
                        f"server {cidr} port {port}: Workload Identity cannot get {component} "
                        "a token for GCS"
                    )
    return problems


def _admits_ip(rule: dict[str, Any], cidr: str, port: int) -> bool:
    """Whether an egress rule lets traffic to ``cidr`` (a /32) on TCP ``port`` out."""
    host = ipaddress.ip_network(cidr).network_address
    peers, ports = rule.get("to"), rule.get("ports")
    peer_ok = peers is None or any(
        "ipBlock" in p
        and host in ipaddress.ip_network(p["ipBlock"]["cidr"])
        and not any(host in ipaddress.ip_network(x) for x in p["ipBlock"].get("except", []))
        for p in peers
    )
    return peer_ok and (ports is None or any(p.get("port") == port for p in ports))


def lifecycle_problems(
    config: RunConfig, objects: Sequence[dict[str, Any]], setup: Sequence[dict[str, Any]]
) -> list[str]:
    """Stopping a run (``kubectl delete -k``) must keep what resuming it needs: the namespace
    and the credentials Secret in it are set up apart, never in the kustomization."""
    t = config.topology
    problems = [
        f"the overlay deletes {o['kind']}/{o['metadata']['name']} when the run stops; set it up "
        f"apart ({gke.SETUP_FILE})"
        for o in objects
        if o["kind"] in ("Namespace", "Secret")
    ]
    if not [o for o in setup if o["kind"] == "Namespace" and o["metadata"]["name"] == t.namespace]:
        problems.append(f"no {gke.SETUP_FILE} beside the overlay makes namespace {t.namespace!r}")
    return problems


def run(config: RunConfig, args: list[str]) -> int:
    from rlax_tpu import cli

    if len(args) != 1:
        print("rlax_tpu.launch.validate: give the overlay's folder (one argument)", file=sys.stderr)
        return cli.EXIT_USAGE
    try:
        objects = build(Path(args[0]))
    except (ValueError, FileNotFoundError, subprocess.TimeoutExpired) as e:
        print(f"rlax_tpu.launch.validate: error: {e}", file=sys.stderr)
        return 1
    setup = setup_objects(Path(args[0]))
    problems = schema_problems([*setup, *objects]) + consistency_problems(config, objects)
    problems += lifecycle_problems(config, objects, setup)
    for p in problems:
        print(f"- {p}")
    print(
        f"{args[0]}: {len(objects)} objects, "
        f"{'valid' if not problems else f'{len(problems)} problems'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    from rlax_tpu import cli

    cli.main("launch.validate", run)
