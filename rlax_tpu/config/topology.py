"""The topology section: where a deployed run's components run."""

from __future__ import annotations

import re

from rlax_tpu.config.checks import bad, frozen, non_negative, positive
from rlax_tpu.config.slices import parse_slice

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
    # A TPU slice as "<generation>:<topology>" (the names `python -m rlax_tpu.aot` compiles for),
    # e.g. "v5p:4x8x8" (config/slices.py); "" runs the component on CPU nodes.
    trainer_tpu: str = ""
    inference_tpu: str = ""  # each worker's slice
    verifier_replicas: int = 1  # verifier pods behind the verifier Service
    controller_memory_gib: int = 8  # controller pod's memory
    param_server_memory_gib: int = 0  # 0: sized from the model (its hot versions + a quarter)
    # The Kubernetes Secret mounted at the token and certificate files' folder: keys "token",
    # "tls.pem" (a certificate for *.<namespace>.svc with its key) and "publish-token".
    credentials_secret: str = "rlax-credentials"
    # Kubernetes service account of the pods (Workload Identity to the run's bucket).
    service_account: str = "rlax"
    # Restarts of the whole JobSet (a preemption restarts every job; the run resumes from its
    # snapshots) before it is marked failed.
    max_restarts: int = 50
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
        positive(self, "verifier_replicas", "controller_memory_gib")
        non_negative(self, "param_server_memory_gib", "max_restarts", "trainer_devices")
        if not self.image:
            raise bad(self, "image", "must be set")
