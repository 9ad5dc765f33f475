"""The run's topology as GKE objects: one JobSet, a Service per endpoint, NetworkPolicies.

``render(config, config_args)`` returns the objects as plain dicts, grouped by the file they go
to; ``python -m rlax_tpu.launch --render=gke --out=DIR`` writes them with a kustomization that
layers them on ``deploy/gke/base``. Every pod runs the same image and the same config flags as the
local launch, plus only what differs per pod (its replica or worker index, its jax.distributed
coordinator and process id). :func:`check` refuses a config whose endpoints, ports, process
counts, meshes or credentials do not match what the render deploys (all problems at once).

Objects (``<name>`` is topology.name, every one in topology.namespace):
- JobSet ``<name>`` (jobset.x-k8s.io/v1alpha2): replicated jobs ``param-server`` (one job per
  replica), ``verifiers`` (topology.verifier_replicas), ``trainer`` (a job per slice of the
  trainer's mesh.slices, one pod per host; one jax.distributed job over all of them, libtpu's
  MEGASCALE_* variables joining the slices), ``inference`` (a job per worker over its slice),
  ``controller``,
  started in that order (startupPolicy InOrder: each waits for the previous ones' readiness).
  The controller finishing ends the JobSet (successPolicy).
- Restarts, at the smallest scope that works (:func:`restart_policy`; the validator refuses a
  render that breaks them). A single-host job (a parameter-server replica, a verifier pod, a
  one-host inference worker, the controller) replaces its own failed pod, up to
  topology.pod_restarts times (``backoffLimit``), and a pod evicted by a drain or preemption
  (pod condition ``DisruptionTarget``; services exit 143 on SIGTERM, so the pod is Failed) does
  not count (``podFailurePolicy`` Ignore): the rest of the run goes on, and the controller
  reconnects to the replacement by its Service name. The processes of a multi-host job (the
  trainer's slice, a multi-host worker's slice) form one jax.distributed job and cannot go on
  without each other: the job fails at its first failed pod (``backoffLimit: 0``), and the JobSet
  restarts every job (failurePolicy), resuming from the controller's snapshots, the trainer's
  checkpoints and the parameter server's persisted versions, all on GCS. A failure of the job
  caused by a disruption (``FailJob`` on ``DisruptionTarget``, job failure reason
  ``PodFailurePolicy``) restarts it without spending topology.max_restarts
  (``RestartJobSetAndIgnoreMaxRestarts``, JobSet's host-maintenance example); any other failure
  spends one. Per-job restarts in the JobSet itself (``RestartJob``) need JobSet >= 0.12; the
  pinned schema is v0.7-v0.11's, so they come from the Jobs.
- Requests: every pod asks for CPU and memory. A TPU pod asks for its host's chips and
  TPU_HOST_FRACTION of the TPU VM's vCPUs and memory (``slices.TPU_VMS``), which fits what GKE
  leaves to pods; CPU pods must fit the CPU node pool's machine (topology.cpu_node_vcpus,
  cpu_node_memory_gb) after GKE's reservations, or the render refuses.
- With topology.kueue_queue set, the JobSet carries the ``kueue.x-k8s.io/queue-name`` label
  (Kueue admits it to that LocalQueue).
- Service ``<name>-<component>[-<index>]`` per endpoint the controller dials, selecting the pod
  that serves it (process 0 of a multi-host job).
- NetworkPolicies: nothing in or out unless listed; the controller reaches every service; the
  trainer publishes to the parameter server; inference workers pull from it; processes of one
  jax.distributed job reach each other; verifiers reach nothing at all.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
from collections.abc import Sequence
from typing import Any

from rlax_tpu import storage
from rlax_tpu.config import ConfigError, MeshConfig, RunConfig
from rlax_tpu.config.libtpu import ENV as LIBTPU_ENV
from rlax_tpu.config.libtpu import libtpu_init_args
from rlax_tpu.config.slices import lays_out
from rlax_tpu.launch.slices import (
    Machine,
    TpuSlice,
    gke_accelerator,
    parse_slice,
    schedulable,
    tpu_vm,
)

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"  # JobSet's 1:1 job placement
COORDINATOR_PORT = 8476  # jax.distributed's coordinator, inside one job
IMAGE_CONFIG_ROOT = "/app"  # the image's working directory: configs/ is under it
TOKEN_KEY, TLS_KEY, PUBLISH_KEY = "token", "tls.pem", "publish-token"
PUBLISHERS = ("trainer", "param-server")  # the pods that get the publish token
GiB = 2**30
# Kueue, "Run A JobSet" (kueue.sigs.k8s.io/docs/tasks/run/jobsets): "The target local queue should
# be specified in the metadata.labels section of the JobSet configuration."
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# The share of a TPU VM's vCPUs and memory a TPU pod requests: under what GKE leaves to pods on
# every TPU VM of slices.TPU_VMS (its reservations, 100 MiB for evictions and slices.SYSTEM_PODS
# for its DaemonSets; tests/launch/test_gke.py checks each). No CPU or memory limit: the pod is
# the node's only workload (it takes every chip), so it may use the rest.
TPU_HOST_FRACTION = 0.8
# The condition of a pod evicted by a drain, a preemption or a node's maintenance: "A pod
# eviction due to maintenance triggers a DisruptionTarget pod condition, which in turn triggers
# the job's podFailurePolicy" (kubernetes-sigs/jobset site/content/en/docs/tasks/failure_policy.md;
# site/static/examples/failure-policy/host-maintenance-event-model.yaml).
DISRUPTION_TARGET = {"type": "DisruptionTarget", "status": "True"}
# JobSet failure-policy rule names: "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$" (jobset_types.go).
RULE_DISRUPTED, RULE_FAILED = "disruptedSliceRestartsFree", "failureSpendsARestart"

# Labels JobSet and Indexed Jobs put on every pod.
L_JOBSET = "jobset.sigs.k8s.io/jobset-name"
L_RJOB = "jobset.sigs.k8s.io/replicatedjob-name"
L_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
L_RJOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
L_POD_INDEX = "batch.kubernetes.io/job-completion-index"

# (replicated job, python module, config section, rpc service name for the probe)
COMPONENTS = {
    "param-server": ("param_server", "param_server", "ParamServer"),
    "verifiers": ("verifiers", "verifiers", "Verifier"),
    "trainer": ("trainer", "trainer", "Trainer"),
    "inference": ("inference", "inference", "Inference"),
}
START_ORDER = ("param-server", "verifiers", "trainer", "inference", "controller")
# The image's user (deploy/docker/Containerfile: USER 1000:1000): every pod but the verifiers'
# runs as it, with its group owning the mounted Secret's files and the scratch folder (fsGroup).
RUN_AS_UID = RUN_AS_GID = 1000
ROOT = ("verifiers",)  # bubblewrap and the switch to per-slot uids need root (in a user namespace)


class RenderError(ValueError):
    """The config cannot be deployed as rendered; the message lists every problem."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    component: str  # replicated job
    index: int  # replica / worker index (0 for trainer and verifiers)
    service: str  # the Service's name
    host: str  # what the controller dials: <service>.<namespace>.svc
    port: int


def endpoints(config: RunConfig) -> list[Endpoint]:
    """The Services the render deploys, one per endpoint the controller must dial."""
    t = config.topology
    found = []
    plan = [
        ("param-server", config.param_server.replicas),
        ("verifiers", 1),
        ("trainer", 1),
        ("inference", config.inference.num_workers),
    ]
    for component, count in plan:
        port = _port(config, component)
        for i in range(count):
            service = f"{t.name}-{component}" + (f"-{i}" if component in _INDEXED else "")
            found.append(Endpoint(component, i, service, f"{service}.{t.namespace}.svc", port))
    return found


_INDEXED = ("param-server", "inference")


def expected_controller_endpoints(config: RunConfig) -> dict[str, Any]:
    """controller.* endpoint fields as the render needs them."""
    by = {}
    for e in endpoints(config):
        by.setdefault(e.component, []).append(f"{e.host}:{e.port}")
    return {
        "param_server_endpoints": tuple(by["param-server"]),
        "verifier_endpoint": by["verifiers"][0],
        "trainer_endpoint": by["trainer"][0],
        "inference_endpoints": tuple(by["inference"]),
    }


def check(config: RunConfig, config_args: Sequence[str]) -> None:
    """RenderError listing every way ``config`` differs from what the render deploys."""
    problems: list[str] = []
    cc, t = config.controller, config.topology
    if cc.transport != "distributed":
        problems.append("controller.transport must be 'distributed' (components run in pods)")
    for field, want in expected_controller_endpoints(config).items():
        got = getattr(cc, field)
        if got != want:
            problems.append(f"controller.{field} is {got!r}; the Services are {want!r}")
    # Ports and credentials: every service listens on all interfaces of its pod with TLS and a
    # token from the one Secret, and the controller presents the same.
    secret_dir = _secret_dir(config)
    for _, section, _ in COMPONENTS.values():
        sec = getattr(config, section)
        host = sec.address.rpartition(":")[0]
        if host not in ("0.0.0.0", "[::]"):
            problems.append(f"{section}.address must listen on 0.0.0.0 in a pod, not {host!r}")
        for field, key in (("auth_token_file", TOKEN_KEY), ("tls_cert_file", TLS_KEY)):
            want = posixpath.join(secret_dir, key)
            if getattr(sec, field) != want:
                problems.append(
                    f"{section}.{field} must be {want!r} (the Secret "
                    f"{t.credentials_secret}'s {key!r}), got {getattr(sec, field)!r}"
                )
    for field, key in (("auth_token_file", TOKEN_KEY), ("tls_cert_file", TLS_KEY)):
        want = posixpath.join(secret_dir, key)
        if getattr(cc, field) != want:
            problems.append(f"controller.{field} must be {want!r}, got {getattr(cc, field)!r}")
    want = posixpath.join(secret_dir, PUBLISH_KEY)
    if config.param_server.publish_token_file != want:
        problems.append(
            f"param_server.publish_token_file must be {want!r} (only the trainer "
            f"and the parameter server get it), got "
            f"{config.param_server.publish_token_file!r}"
        )
    # Process counts and meshes against the slices.
    for section, tpu in (("trainer", t.trainer_tpu), ("inference", t.inference_tpu)):
        sec = getattr(config, section)
        slices = slice_count(config, section)
        hosts = (parse_slice(tpu).hosts if tpu else 1) * slices
        if sec.distributed.num_processes != hosts:
            where = f"{slices} x {tpu}" if slices > 1 else tpu or "a CPU pod"
            problems.append(
                f"{section}.distributed.num_processes is "
                f"{sec.distributed.num_processes}, but {where} has {hosts} host(s)"
            )
        if slices > 1 and hosts == slices:
            # "you cannot use Multislice with a ct4p-hightpu-4t with a 2x2x1 topology or a
            # ct5lp-hightpu-4t with a 2x2 topology" (cloud.google.com/tpu/docs/tpu-gke-multislice:
            # it "only supports multi-host TPU slice node pools").
            problems.append(
                f"mesh.slices is {slices}: GKE runs multislice only over multi-host slices, "
                f"and {tpu or 'a CPU pod'} is one host (topology.trainer_tpu)"
            )
        mesh = config.mesh if section == "trainer" else config.inference.mesh
        if tpu:
            problems += mesh_problems(mesh, parse_slice(tpu), section)
    # Everything a restarted pod resumes from must outlive the pod.
    for field, value in (
        ("controller.run_dir", cc.run_dir),
        ("param_server.persist_path", config.param_server.persist_path),
    ):
        if value and not storage.is_remote(value):
            problems.append(f"{field} must be on GCS (gs://...) to survive a pod, got {value!r}")
    if config.param_server.persist_every == 0:
        problems.append(
            "param_server.persist_every must be > 0: a restarted parameter server "
            "serves its persisted versions"
        )
    if config.verifiers.repository_dir and storage.is_remote(config.verifiers.repository_dir):
        problems.append("verifiers.repository_dir must be local: verifier pods have no network")
    v = config.verifiers
    if v.sandbox_uid + v.workers > 65534:
        problems.append(
            f"verifiers.sandbox_uid + workers = {v.sandbox_uid + v.workers} must be "
            "<= 65534: verifier pods run in a user namespace of 65536 ids"
        )
    if cc.warmup_steps:
        problems.append(
            "controller.warmup_steps must be 0 (a cluster run starts from "
            "model.weights_path; warm up with the local launch)"
        )
    problems += image_problems(config)
    problems += node_fit_problems(config)
    config_file = _config_file(config_args)
    if config_file.startswith("/") or config_file.startswith(".."):
        problems.append(
            f"--config={config_file}: the config file must be a path inside the "
            "repository (the image holds it under /app)"
        )
    if problems:
        raise RenderError(
            "the config does not match its GKE deployment:\n  - " + "\n  - ".join(problems)
        )


def pod_image(config: RunConfig) -> str:
    """The image reference every pod runs: ``<topology.registry>/<topology.image>``, or the image
    as written when no registry is set."""
    t = config.topology
    return f"{t.registry}/{t.image}" if t.registry else t.image


def registry_host(image: str) -> str:
    """The registry host an image reference names ("" for none): its first path component when
    that has a '.' or a ':' or is "localhost" (the distribution reference grammar's rule;
    without one, a runtime pulls from docker.io)."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return ""


def pull_policy(image: str) -> str:
    """Always for a moving tag (":latest" or none: a node that cached an older push would run it),
    IfNotPresent for a fixed tag or a digest (Kubernetes' own defaults for the two)."""
    if "@sha256:" in image:
        return "IfNotPresent"
    tag = image.rpartition("/")[2].partition(":")[2]
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def image_problems(config: RunConfig) -> list[str]:
    """Why the cluster's nodes could not pull the pods' image ([] when they can)."""
    t, image = config.topology, pod_image(config)
    host = registry_host(image)
    if not host:
        return [
            f"the pods' image {image!r} names no registry: a GKE node would pull "
            f"docker.io/library/{image.split(':')[0]}, not this project's image. Push the image "
            "(make image) and set topology.registry, e.g. "
            "--config.topology.registry=us-docker.pkg.dev/PROJECT/REPO (or give topology.image "
            "with its registry)"
        ]
    if host == "localhost":
        return [
            f"the pods' image {image!r} is on this machine (localhost/), which no GKE node can "
            "reach: push it to a registry and set topology.registry"
        ]
    if t.registry and registry_host(t.image):
        return [
            f"topology.image {t.image!r} names its registry and topology.registry is set too "
            f"(the pods would run {image!r}): set one of them"
        ]
    return []


def cpu_node(config: RunConfig) -> Machine:
    """The CPU node pool's machine, as the topology section states it."""
    t = config.topology
    return Machine("topology.cpu_node_*", t.cpu_node_vcpus, t.cpu_node_memory_gb, "the config")


def node_fit_problems(config: RunConfig) -> list[str]:
    """Why a CPU pod of the render would fit no CPU node (topology.cpu_node_vcpus and
    cpu_node_memory_gb, after GKE's reservations and its DaemonSets); [] if each fits."""
    t = config.topology
    node = cpu_node(config)
    cpus, memory = schedulable(node)
    problems = []
    for component in START_ORDER:
        if _slice(config, component) is not None:
            continue
        cpu, mem = pod_requests(config, component, None)
        if cpu <= cpus and mem <= memory:
            continue
        if component == "verifiers":
            v = config.verifiers
            total = v.workers * t.verifier_replicas
            fit = max(1, int(cpus))
            per_pod = max(w for w in range(1, fit + 1) if total % w == 0)
            hint = (
                f"run more, smaller verifier pods: topology.verifier_replicas x verifiers.workers "
                f"= {total} sandboxes, at most {fit} workers per pod (e.g. "
                f"{total // per_pod} x {per_pod})"
            )
        elif component == "param-server":
            hint = (
                "a larger CPU machine (topology.cpu_node_*), or fewer "
                "param_server.in_memory_versions"
            )
        else:
            hint = "a larger CPU machine (topology.cpu_node_*)"
        problems.append(
            f"a {component} pod requests {cpu:g} CPUs and {mem / GiB:.1f} GiB, but a CPU node "
            f"(topology.cpu_node_vcpus={t.cpu_node_vcpus}, cpu_node_memory_gb="
            f"{t.cpu_node_memory_gb}) leaves {cpus:.1f} CPUs and {memory / GiB:.1f} GiB to "
            f"pods after GKE's reservations: {hint}"
        )
    return problems


def mesh_problems(mesh: MeshConfig, tpu: TpuSlice, section: str) -> list[str]:
    """Why ``section``'s mesh does not lay out over exactly the slice's devices ([] if it does)."""
    where = "mesh" if section == "trainer" else "inference.mesh"
    try:
        shape = mesh.shape(tpu.devices)
    except ConfigError as e:
        return [f"{where} does not fit {tpu.name} ({tpu.devices} devices): {e.why}"]
    total = math.prod(shape)
    if total != tpu.devices:
        return [f"{where} {shape} uses {total} of {tpu.name}'s {tpu.devices} devices"]
    # JAX lays v4, v5p and v6e slices past 8 chips out by whole torus axes (slices of up to 8
    # chips have orderings of their own, and v5e may split torus axes: both take any shape).
    if tpu.generation in ("v4", "v5p", "v6e") and tpu.chips > 8 and not lays_out(shape, tpu.dims):
        return [
            f"{where} (data, fsdp, expert, tensor) = {shape} does not map onto {tpu.name}'s "
            "torus: "
            "each mesh axis must be a product of some of its dimensions "
            f"({', '.join(map(str, tpu.dims))})"
        ]
    return []


def _port(config: RunConfig, component: str) -> int:
    section = COMPONENTS[component][1]
    return int(getattr(config, section).address.rpartition(":")[2])


def _config_file(config_args: Sequence[str]) -> str:
    for a in config_args:
        if a.startswith("--config="):
            return a.removeprefix("--config=").split(":", 1)[0]
    raise RenderError("the render needs the --config=FILE[:PRESET] flag the pods will use")


def param_server_memory_bytes(config: RunConfig) -> int:
    """Its hot versions in the publish dtype, with ``fanout`` "relay" one more (the relay root's
    copy of the version it serves) and with relay deltas two more (a base read while a delta is
    encoded, and the delta), a quarter more for the version being written and the serving
    buffers, and 2 GiB for the process."""
    if config.topology.param_server_memory_gib:
        return config.topology.param_server_memory_gib * GiB
    itemsize = 2 if config.trainer.publish_dtype == "bfloat16" else 4
    ps = config.param_server
    versions = ps.in_memory_versions
    if ps.fanout == "relay":
        versions += 1 + (2 if ps.relay_deltas > 1 else 0)
    return int(config.model.param_count() * itemsize * versions * 1.25) + 2 * GiB


def _gib(n: int) -> str:
    return f"{-(-n // GiB)}Gi"


def render(config: RunConfig, config_args: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """{file name: [objects]} for ``config``, whose pods start with ``config_args`` (the
    ``--config=`` and ``--config.a.b=`` flags). Raises RenderError (see :func:`check`)."""
    check(config, config_args)
    jobset = _jobset(config, list(config_args))
    return {
        "jobset.yaml": [jobset],
        "services.yaml": [_service(config, e) for e in endpoints(config)],
        "network-policies.yaml": network_policies(config),
    }


# Set-up objects, applied once and kept when a run stops (``kubectl delete -k`` on the overlay
# deletes what its kustomization lists; the credentials Secret lives in this namespace).
SETUP_FILE = "namespace.yaml"


def namespace(config: RunConfig) -> dict[str, Any]:
    """The run's Namespace. Verifier pods need more than "restricted" Pod Security (bubblewrap:
    SYS_ADMIN in a user namespace); every other pod would pass it."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": config.topology.namespace,
            "labels": {
                "pod-security.kubernetes.io/enforce": "privileged",
                "pod-security.kubernetes.io/warn": "restricted",
            },
        },
    }


# -- the JobSet ----------------------------------------------------------------------------------


def _slice(config: RunConfig, component: str) -> TpuSlice | None:
    t = config.topology
    name = {"trainer": t.trainer_tpu, "inference": t.inference_tpu}.get(component, "")
    return parse_slice(name) if name else None


def slice_count(config: RunConfig, component: str) -> int:
    """How many slices ``component`` spans (the trainer's mesh.slices; one for the rest)."""
    return config.mesh.slices if component == "trainer" else 1


def multi_host(config: RunConfig, component: str) -> bool:
    """Whether ``component``'s job is one jax.distributed job over several hosts (of one or
    several slices)."""
    tpu = _slice(config, component)
    return tpu is not None and tpu.hosts * slice_count(config, component) > 1


def restart_policy(config: RunConfig) -> dict[str, Any]:
    """The JobSet's failurePolicy. JobSet evaluates the rules in order and runs only the first
    that matches a failed job ("If no matching rule is found, the RestartJobSet action is
    applied"; jobset_types.go). A multi-host job failed by its podFailurePolicy (a disrupted
    host: reason PodFailurePolicy) restarts the JobSet without spending maxRestarts (JobSet's
    host-maintenance example, site/static/examples/failure-policy/
    host-maintenance-event-model.yaml); every other failure restarts it and spends one."""
    rules: list[dict[str, Any]] = []
    sliced = [c for c in START_ORDER if multi_host(config, c)]
    if sliced:
        rules.append(
            {
                "name": RULE_DISRUPTED,
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "targetReplicatedJobs": sliced,
            }
        )
    rules.append({"name": RULE_FAILED, "action": "RestartJobSet"})
    return {"maxRestarts": config.topology.max_restarts, "rules": rules}


def _jobset(config: RunConfig, args: list[str]) -> dict[str, Any]:
    t = config.topology
    replicas = {
        "param-server": config.param_server.replicas,
        "verifiers": t.verifier_replicas,
        "trainer": config.mesh.slices,  # a job per slice (JobSet's multislice shape)
        "inference": config.inference.num_workers,
        "controller": 1,
    }
    labels = {"app.kubernetes.io/name": "rlax-tpu"}
    if t.kueue_queue:
        labels[KUEUE_QUEUE_LABEL] = t.kueue_queue
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": t.name, "labels": labels},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": t.name},
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["controller"]},
            "failurePolicy": restart_policy(config),
            "replicatedJobs": [
                _replicated(config, name, replicas[name], _slice(config, name), args)
                for name in START_ORDER
            ],
        },
    }


def _replicated(
    config: RunConfig, component: str, replicas: int, tpu: TpuSlice | None, args: list[str]
) -> dict[str, Any]:
    hosts = tpu.hosts if tpu else 1
    pod = _pod(config, component, tpu, args)
    job_meta: dict[str, Any] = {}
    if tpu is not None and tpu.hosts > 1:
        # A multi-host slice's pods must land on the nodes of one node pool (one slice, its ICI),
        # and no other job's. JobSet: the annotation "defines 1:1 job to topology placement"
        # (jobset.sigs.k8s.io, concepts). Not on single-host jobs: one node is a whole slice,
        # and 1:1 would need a node pool per worker (with one shared pool only one schedules).
        job_meta["annotations"] = {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    if multi_host(config, component):
        # One jax.distributed job: its first failed pod fails the job (a replacement could not
        # rejoin), a disrupted one with reason PodFailurePolicy (see restart_policy).
        backoff, on_disruption = 0, "FailJob"
    else:
        # The job replaces its own pod; an evicted pod is replaced without counting
        # (kubernetes/website examples/controllers/job-pod-failure-policy-ignore.yaml).
        backoff, on_disruption = config.topology.pod_restarts, "Ignore"
    return {
        "name": component,
        "replicas": replicas,
        "template": {
            "metadata": job_meta,
            "spec": {
                "parallelism": hosts,
                "completions": hosts,
                "completionMode": "Indexed",
                "backoffLimit": backoff,
                "podFailurePolicy": {
                    "rules": [{"action": on_disruption, "onPodConditions": [DISRUPTION_TARGET]}]
                },
                "template": pod,
            },
        },
    }


def _pod(
    config: RunConfig, component: str, tpu: TpuSlice | None, args: list[str]
) -> dict[str, Any]:
    t = config.topology
    module = COMPONENTS[component][0] if component in COMPONENTS else "controller"
    container: dict[str, Any] = {
        "name": component,
        "image": pod_image(config),
        "imagePullPolicy": pull_policy(pod_image(config)),
        "workingDir": IMAGE_CONFIG_ROOT,
        "command": ["python", "-m", f"rlax_tpu.{module}"],
        "args": [*args, *_pod_args(config, component, tpu)],
        "env": [
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {
                "name": "JOB_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{L_JOB_INDEX}']"}},
            },
        ],
        "volumeMounts": [
            {"name": "credentials", "mountPath": _secret_dir(config), "readOnly": True},
            {"name": "scratch", "mountPath": "/tmp"},
        ],
        "resources": _resources(config, component, tpu),
        "securityContext": _security(component),
    }
    if component == "controller" and uses_wandb_online(config):
        key = {"name": t.wandb_secret, "key": "api_key"}
        container["env"].append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": key}})
    if slice_count(config, component) > 1:
        container["env"] += megascale_env(config, component)
    flags = libtpu_init_args(config, component)
    if tpu is not None and flags:  # the flags the AOT check compiles with
        container["env"].append({"name": LIBTPU_ENV, "value": flags})
    if component in COMPONENTS:
        port = _port(config, component)
        container["ports"] = [{"name": "grpc", "containerPort": port}]
        probe = _probe(config, component, port)
        container["readinessProbe"] = probe | {"periodSeconds": 10, "failureThreshold": 3}
        # Start-up (weights, compiles) can take many minutes; liveness starts after it.
        container["startupProbe"] = probe | {"periodSeconds": 10, "failureThreshold": 180}
        container["livenessProbe"] = probe | {"periodSeconds": 30, "failureThreshold": 5}
    if tpu is not None:
        container["ports"] = [
            *container.get("ports", []),
            {"name": "coordinator", "containerPort": COORDINATOR_PORT},
        ]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": t.service_account,
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": [
            {
                "name": "credentials",
                "secret": {
                    "secretName": t.credentials_secret,
                    "defaultMode": 0o440,
                    # The publish token only where weights are written.
                    "items": [
                        {"key": k, "path": k}
                        for k in (
                            TOKEN_KEY,
                            TLS_KEY,
                            *([PUBLISH_KEY] if component in PUBLISHERS else []),
                        )
                    ],
                },
            },
            {"name": "scratch", "emptyDir": {}},
        ],
    }
    if component not in ROOT:
        # The image's user, stated so the kubelet refuses to start the pod as root
        # (runAsNonRoot), and its group owning the Secret's files (mode 0440) and the scratch.
        spec["securityContext"] = {
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_GID,
            "runAsNonRoot": True,
            "fsGroup": RUN_AS_GID,
        }
    if tpu is not None:
        spec["nodeSelector"] = {
            "cloud.google.com/gke-tpu-accelerator": gke_accelerator(tpu),
            "cloud.google.com/gke-tpu-topology": tpu.topology,
        }
    if component == "verifiers":
        # Root inside a user namespace: bubblewrap's mounts and uid switches stay in the pod.
        spec["hostUsers"] = False
        spec["automountServiceAccountToken"] = False
    return {"metadata": {"labels": {"app.kubernetes.io/component": component}}, "spec": spec}


def uses_wandb_online(config: RunConfig) -> bool:
    """The controller logs to W&B's server (the wandb sink, not offline): it needs a key."""
    obs = config.observability
    return "wandb" in obs.sinks and obs.wandb.mode == "online"


def megascale_env(config: RunConfig, component: str) -> list[dict[str, Any]]:
    """What libtpu's multislice runtime reads to join the slices over DCN: how many, which one
    this pod's is, and where slice 0's coordinator is. GKE's docs name no injector for these in
    a plain JobSet; JobSet's own answer is to set them from its labels
    (kubernetes-sigs/jobset issue #787; xpk's src/xpk/templates/pathways_workload_create.yaml.j2
    sets the same three)."""
    t = config.topology

    def label(key: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": f"metadata.labels['{key}']"}}

    return [
        {"name": "MEGASCALE_NUM_SLICES", "valueFrom": label(L_RJOB_REPLICAS)},
        {"name": "MEGASCALE_SLICE_ID", "valueFrom": label(L_JOB_INDEX)},
        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{t.name}-{component}-0-0.{t.name}"},
    ]


def _pod_args(config: RunConfig, component: str, tpu: TpuSlice | None) -> list[str]:
    """What differs per pod: its index, and its place in a jax.distributed job."""
    t = config.topology
    out = []
    if component == "param-server":
        out.append("--config.param_server.replica_index=$(JOB_INDEX)")
    if component == "inference":
        out.append("--config.inference.worker_index=$(JOB_INDEX)")
    if component in ("trainer", "inference") and multi_host(config, component):
        if slice_count(config, component) > 1:
            # One jax.distributed job over every slice's job: slice 0's first pod coordinates,
            # a pod's index is its slice's (the job index) and its own within the slice.
            lead = f"{t.name}-{component}-0-0.{t.name}:{COORDINATOR_PORT}"
            out.append(f"--config.{component}.distributed.slice_index=$(JOB_INDEX)")
        else:
            lead = f"{t.name}-{component}-$(JOB_INDEX)-0.{t.name}:{COORDINATOR_PORT}"
        out += [
            f"--config.{component}.distributed.coordinator_address={lead}",
            f"--config.{component}.distributed.process_id=$(JOB_COMPLETION_INDEX)",
        ]
    return out


def _secret_dir(config: RunConfig) -> str:
    return posixpath.dirname(config.controller.auth_token_file) or "/var/run/secrets/rlax"


def _probe(config: RunConfig, component: str, port: int) -> dict[str, Any]:
    d, service = _secret_dir(config), COMPONENTS[component][2]
    name = next(e.host for e in endpoints(config) if e.component == component)
    return {
        "exec": {
            "command": [
                "python",
                "-m",
                "rlax_tpu.rpc.probe",
                service,
                f"127.0.0.1:{port}",
                f"--token_file={d}/{TOKEN_KEY}",
                f"--tls_cert_file={d}/{TLS_KEY}",
                f"--server_name={name}",
                "--lead_only",
                *(["--lead_job_only"] if slice_count(config, component) > 1 else []),
            ]
        },
        "timeoutSeconds": 10,
    }


def pod_requests(config: RunConfig, component: str, tpu: TpuSlice | None) -> tuple[float, int]:
    """(CPUs, memory bytes) one pod of ``component`` requests."""
    if tpu is not None:
        vm = tpu_vm(tpu)
        return int(vm.vcpus * TPU_HOST_FRACTION), int(vm.memory_bytes * TPU_HOST_FRACTION)
    if component == "param-server":
        return 4, param_server_memory_bytes(config)
    if component == "verifiers":
        v = config.verifiers
        # A sandbox per worker at its memory limit, the compilers, and the service itself.
        return v.workers, int(v.workers * v.memory_limit_mb * 2**20 * 1.5) + 2 * GiB
    if component == "controller":
        return 4, config.topology.controller_memory_gib * GiB
    return 8, 32 * GiB  # a trainer or worker on CPU


def _resources(config: RunConfig, component: str, tpu: TpuSlice | None) -> dict[str, Any]:
    cpu, memory = pod_requests(config, component, tpu)
    requests = {"cpu": f"{cpu:g}", "memory": _gib(memory)}
    if tpu is not None:
        chips = str(tpu.chips_per_host)
        # Memory in GiB rounded down, so the request stays under the fraction.
        requests["memory"] = f"{memory // GiB}Gi"
        return {
            "requests": {"google.com/tpu": chips, **requests},
            "limits": {"google.com/tpu": chips},
        }
    return {"requests": requests, "limits": {"memory": requests["memory"]}}


def _security(component: str) -> dict[str, Any]:
    if component == "verifiers":
        # What bubblewrap and the sandbox launcher need, and nothing else: namespaces and mounts
        # (SYS_ADMIN), switching to the per-slot uids (SETUID, SETGID), chown of a run's folder
        # and killing what a program leaves (CHOWN, FOWNER, DAC_OVERRIDE, KILL). /proc unmasked
        # so bubblewrap can mount a fresh one in the sandbox's pid namespace.
        return {
            # Over the image's USER 1000:1000: root's uid and group.
            "runAsUser": 0,
            "runAsGroup": 0,
            "allowPrivilegeEscalation": False,
            "procMount": "Unmasked",
            "appArmorProfile": {"type": "Unconfined"},
            "seccompProfile": {"type": "RuntimeDefault"},
            "capabilities": {
                "drop": ["ALL"],
                "add": ["SYS_ADMIN", "SETUID", "SETGID", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL"],
            },
        }
    # Every other pod: the image's non-root user (the pod's securityContext), no capabilities.
    # TPU pods too; that the chips' device files, which GKE's TPU device plugin puts in the
    # container (google.com/tpu), open for a non-root uid is not verified on a cluster
    # (docs/deployment.md says how to go back to root for them).
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "seccompProfile": {"type": "RuntimeDefault"},
        "capabilities": {"drop": ["ALL"]},
    }


def _service(config: RunConfig, e: Endpoint) -> dict[str, Any]:
    t = config.topology
    selector = {L_JOBSET: t.name, L_RJOB: e.component}
    if e.component != "verifiers":  # verifier replicas share one Service
        selector |= {L_JOB_INDEX: str(e.index), L_POD_INDEX: "0"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": e.service, "labels": {"app.kubernetes.io/component": e.component}},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "grpc", "port": e.port, "targetPort": e.port, "protocol": "TCP"}],
        },
    }


# -- network policies ----------------------------------------------------------------------------

# Who may open connections to whom (component -> component, on the destination's gRPC port).
EDGES = (
    ("controller", "param-server"),
    ("controller", "verifiers"),
    ("controller", "trainer"),
    ("controller", "inference"),
    ("trainer", "param-server"),  # publish
    ("inference", "param-server"),  # pull
)
# Components that reach GCS (run directory, checkpoints, persisted versions, weights).
GCS_CLIENTS = ("controller", "trainer", "inference", "param-server")
# Processes of one jax.distributed job reach each other; inference workers also relay versions
# to each other (param_server.fanout "relay", on their gRPC port).
PEERS = ("trainer", "inference")
# https://cloud.google.com/kubernetes-engine/docs/concepts/workload-identity (read 2026-11): "If
# you have a strict cluster network policy in place, you must allow egress to ... 169.254.169.252/32
# on port 988. For clusters running GKE Dataplane V2, ensure that you allowed egress to
# 169.254.169.254/32 on port 80." Both, so the policy holds on either dataplane.
METADATA_SERVER_EGRESS = (("169.254.169.252/32", 988), ("169.254.169.254/32", 80))


def network_policies(config: RunConfig) -> list[dict[str, Any]]:
    t = config.topology

    def pods(component: str) -> dict[str, Any]:
        return {"matchLabels": {L_JOBSET: t.name, L_RJOB: component}}

    def policy(name: str, component: str, ingress: list, egress: list) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{t.name}-{name}"},
            "spec": {
                "podSelector": pods(component),
                "policyTypes": ["Ingress", "Egress"],
                "ingress": ingress,
                "egress": egress,
            },
        }

    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    gcs = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP", "port": 443}]}
    # Workload Identity's tokens come from the GKE metadata server (METADATA_SERVER_EGRESS).
    metadata = [
        {"to": [{"ipBlock": {"cidr": cidr}}], "ports": [{"protocol": "TCP", "port": port}]}
        for cidr, port in METADATA_SERVER_EGRESS
    ]
    out = []
    for component in (*COMPONENTS, "controller"):
        ingress = [
            {
                "from": [{"podSelector": pods(src)}],
                "ports": [{"protocol": "TCP", "port": _port(config, dst)}],
            }
            for src, dst in EDGES
            if dst == component
        ]
        egress = [
            {
                "to": [{"podSelector": pods(dst)}],
                "ports": [{"protocol": "TCP", "port": _port(config, dst)}],
            }
            for src, dst in EDGES
            if src == component
        ]
        if component in PEERS:
            ingress.append({"from": [{"podSelector": pods(component)}]})
            egress.append({"to": [{"podSelector": pods(component)}]})
        if component in GCS_CLIENTS:
            egress += [dns, gcs, *metadata]
        elif component != "verifiers":
            egress.append(dns)
        out.append(policy(component, component, ingress, egress))
    return out
