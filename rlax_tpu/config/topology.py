"""The topology section: where a deployed run's components run."""

from __future__ import annotations

import re

from rlax_tpu.config.checks import bad, frozen, non_negative, positive
from rlax_tpu.config.slices import parse_slice

# A libtpu flag: names as libtpu's (some start with a digit), values without what a shell or
# Kubernetes' $(VAR) expansion would change.
_LIBTPU_FLAG = re.compile(r"--[a-z0-9][a-z0-9_]*(=[A-Za-z0-9_.,:/+=-]*)?")
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@frozen
class TopologyConfig:
    """Where the components run when the run is deployed (``rlax_tpu.launch``).

    How many of each component there are lives in their own sections (trainer.distributed
    .num_processes, inference.num_workers and inference.distributed.num_processes,
    param_server.replicas); their ports and credentials in their addresses and token files. This
    section adds what only a cluster needs: the slices the trainer and each inference worker run
    on, the pods' image, sizes and restart budget. The local launch and the GKE render read the
    same config, so the two cannot drift.
    """

    name: str = "rlax"  # the JobSet's name, prefix of every object and Service name
    namespace: str = "rlax"  # Kubernetes namespace of every object
    image: str = "rlax-tpu:latest"  # one image for every component (deploy/docker/Containerfile)
    # The registry the cluster's nodes pull ``image`` from: pods run ``<registry>/<image>``, e.g.
    # "us-docker.pkg.dev/PROJECT/REPO" (Artifact Registry). "" uses ``image`` as written, which
    # the GKE render accepts only when it names its own registry host: a GKE node cannot pull
    # "rlax-tpu:latest" (that is docker.io/library/rlax-tpu, not this project's image).
    registry: str = ""
    # A TPU slice as "<generation>:<topology>" (the names `python -m rlax_tpu.aot` compiles for),
    # e.g. "v5p:4x8x8" (config/slices.py); "" runs the component on CPU nodes.
    trainer_tpu: str = ""
    inference_tpu: str = ""  # each worker's slice
    # LIBTPU_INIT_ARGS of the TPU processes (every launcher) and of `python -m rlax_tpu.aot`:
    # "auto", MaxText's flags (the trainer's collectives overlapped with compute, a scoped VMEM
    # limit; config/libtpu.py cites each); "" none; anything else, these flags as written.
    libtpu_init_args: str = "auto"
    verifier_replicas: int = 1  # verifier pods behind the verifier Service
    controller_memory_gib: int = 8  # controller pod's memory
    param_server_memory_gib: int = 0  # 0: sized from the model (its hot versions + a quarter)
    # The Kubernetes Secret mounted at the token and certificate files' folder: keys "token",
    # "tls.pem" (a certificate for *.<namespace>.svc with its key) and "publish-token".
    credentials_secret: str = "rlax-credentials"
    # With the wandb sink (observability.sinks, online): the Secret whose key "api_key" the
    # controller pod gets as WANDB_API_KEY (kubectl create secret generic rlax-wandb
    # --from-literal=api_key=...).
    wandb_secret: str = "rlax-wandb"
    # Kubernetes service account of the pods (Workload Identity to the run's bucket).
    service_account: str = "rlax"
    # Restarts of the whole JobSet, after a failure of a multi-host job (one of its processes
    # failed: the jax.distributed job restarts, and with it every component; the run resumes from
    # its snapshots) or of a single-host job that spent pod_restarts, before the run is marked
    # failed. A preempted or drained multi-host slice restarts the JobSet without spending it.
    max_restarts: int = 50
    # Failed pods a single-host job (a parameter-server replica, a verifier pod, a one-host
    # inference worker, the controller) replaces by itself, the rest of the run untouched, before
    # the job fails (and restarts the JobSet). A pod evicted by a drain or preemption is replaced
    # without counting.
    pod_restarts: int = 10
    # The largest machine of the cluster's CPU node pools, which run every pod without a TPU
    # (parameter-server replicas, verifier pods, the controller): vCPUs and memory in GB as
    # Compute Engine lists them (default n2-standard-32). The render refuses a pod that would not
    # fit on it after GKE's reservations.
    cpu_node_vcpus: int = 32
    cpu_node_memory_gb: int = 128  # that machine's memory in GB (n2-standard-32: 128)
    # Kueue LocalQueue the JobSet is submitted to (the kueue.x-k8s.io/queue-name label); "" runs
    # it without Kueue.
    kueue_queue: str = ""
    # One host, local transport (a single TPU VM): the trainer's mesh takes the first
    # trainer_devices devices and inference worker i the i-th group of inference.mesh's size
    # after them, so training and generation run side by side on their own chips. 0: every
    # component lays its mesh over all the devices (they take turns on them).
    trainer_devices: int = 0

    def __post_init__(self) -> None:
        for n in ("name", "namespace", "credentials_secret", "service_account"):
            if not _DNS_LABEL.fullmatch(getattr(self, n)) or len(getattr(self, n)) > 40:
                raise bad(self, n, "must be a DNS label (a-z, 0-9, '-'; at most 40 characters)")
        for n in ("trainer_tpu", "inference_tpu"):
            if getattr(self, n):
                try:
                    parse_slice(getattr(self, n))
                except ValueError as e:
                    raise bad(
                        self, n, f"must be '' or a TPU slice such as 'v5p:2x2x1': {e}"
                    ) from None
        positive(
            self,
            "verifier_replicas",
            "controller_memory_gib",
            "cpu_node_vcpus",
            "cpu_node_memory_gb",
        )
        non_negative(
            self, "param_server_memory_gib", "max_restarts", "pod_restarts", "trainer_devices"
        )
        if self.kueue_queue and (
            not _DNS_LABEL.fullmatch(self.kueue_queue) or len(self.kueue_queue) > 63
        ):
            raise bad(self, "kueue_queue", "must be '' or a LocalQueue name (a DNS label)")
        if not self.image:
            raise bad(self, "image", "must be set")
        if self.libtpu_init_args != "auto" and not all(
            _LIBTPU_FLAG.fullmatch(f) for f in self.libtpu_init_args.split()
        ):
            raise bad(
                self,
                "libtpu_init_args",
                "must be 'auto', '' or flags such as '--xla_tpu_scoped_vmem_limit_kib=98304' "
                "separated by spaces",
            )
        if "://" in self.registry or self.registry.endswith("/") or " " in self.registry:
            raise bad(
                self, "registry", "must be '' or a registry path such as us-docker.pkg.dev/P/R"
            )
