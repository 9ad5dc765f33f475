"""Joining a ``jax.distributed`` job: one component (an inference worker, the trainer) whose mesh
spans the devices of several hosts, one process per host.

Call :func:`initialize` before anything touches a JAX device: the job's processes agree on the
global device list when they join, and every process then builds the same mesh over it.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from rlax_tpu.config import DistributedConfig

log = logging.getLogger(__name__)


def initialize(cfg: DistributedConfig) -> bool:
    """Joins the job ``cfg`` names (nothing for one process); True when this process is the
    lead (process 0), the one that serves callers."""
    if not cfg.enabled:
        return True
    import jax

    # CPU devices take part in cross-process collectives only through gloo (jax's CPU default
    # has none); TPU and GPU collectives are unaffected.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg.coordinator_address == "auto":
        jax.distributed.initialize(initialization_timeout=cfg.initialization_timeout_s)
    else:
        jax.distributed.initialize(
            cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            initialization_timeout=cfg.initialization_timeout_s,
        )
    log.info(
        "joined jax.distributed as process %d of %d (%d local of %d devices)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return jax.process_index() == 0


def broadcast(payload: Any) -> Any:
    """Process 0's ``payload`` (any picklable value; other processes pass None) on every
    process. A collective: every process of the job calls it, the same number of times."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    lead = jax.process_index() == 0
    data = np.frombuffer(pickle.dumps(payload), np.uint8) if lead else np.zeros(0, np.uint8)
    size = multihost_utils.broadcast_one_to_all(np.array([data.size], np.int64))
    buffer = np.zeros(int(size[0]), np.uint8)
    if lead:
        buffer[:] = data
    received = multihost_utils.broadcast_one_to_all(buffer)
    return pickle.loads(np.asarray(received, np.uint8).tobytes())  # noqa: S301 - our own lead


def shutdown(cfg: DistributedConfig) -> None:
    """Leaves the job (a barrier: every process waits for the others)."""
    if cfg.enabled:
        import jax

        jax.distributed.shutdown()
