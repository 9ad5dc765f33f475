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


def initialize(cfg: DistributedConfig, *, slices: int = 1) -> bool:
    """Joins the job ``cfg`` names (nothing for one process); True when this process is the
    lead (process 0), the one that serves callers. ``slices``: the slices the job spans (its
    processes are numbered slice by slice)."""
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
            process_id=cfg.job_process_id(slices),
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


# The control channel: jax.distributed's key-value store (the coordination service, which runs
# in process 0, the lead). Payloads go in keys of at most _CHUNK bytes; a follower's wait is a
# loop of _WAIT_MS-long blocking reads, so an idle follower blocks on the host, not in a device
# collective, and nothing is compiled for any payload size.
_PREFIX = "rlax/broadcast"
_CHUNK = 2**20
_WAIT_MS = 10_000
_next = [0]  # the number of this process's next payload (the same on every process)


def broadcast(payload: Any) -> Any:
    """Process 0's ``payload`` (any picklable value; other processes pass None) on every
    process. Every process of the job calls it the same number of times: the n-th call of a
    follower returns the lead's n-th payload. The lead writes the pickled payload (in chunks,
    its head last) and returns at once; a follower waits for it; the last follower to read a
    payload deletes its keys. A follower whose lead died gets the coordination service's error."""
    import jax

    if jax.process_count() == 1:
        return payload
    client = _client()
    key = f"{_PREFIX}/{_next[0]}"
    if jax.process_index() == 0:
        # Pickled before anything is written, and the number is taken only once the head is:
        # a payload that cannot be sent leaves the followers waiting for the same number.
        data = pickle.dumps(payload)
        chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        try:
            for i, chunk in enumerate(chunks[1:], start=1):
                client.key_value_set_bytes(f"{key}/{i}", chunk)
            client.key_value_set_bytes(key, len(chunks).to_bytes(4, "little") + chunks[0])
        except Exception:
            client.key_value_delete(key)  # the chunks written so far
            raise
        _next[0] += 1
        return payload
    head = _wait(client, key)
    parts = [head[4:]]
    for i in range(1, int.from_bytes(head[:4], "little")):
        parts.append(client.blocking_key_value_get_bytes(f"{key}/{i}", _WAIT_MS))
    _next[0] += 1
    if client.key_value_increment(f"{key}/read", 1) == jax.process_count() - 1:
        client.key_value_delete(key)  # the key and every key under key/
    return pickle.loads(b"".join(parts))  # noqa: S301 - our own lead's


_EXCHANGE_PREFIX = "rlax/exchange"
_exchanges = [0]


def exchange(value: Any) -> list[Any]:
    """Every process's picklable ``value``, in process order, on every process. On the host
    (the key-value store), so a process that failed before a device collective can still say
    so and every process decides alike. Every process calls it the same number of times."""
    import jax

    if jax.process_count() == 1:
        return [value]
    client, me, count = _client(), jax.process_index(), jax.process_count()
    key = f"{_EXCHANGE_PREFIX}/{_exchanges[0]}"
    _exchanges[0] += 1
    client.key_value_set_bytes(f"{key}/{me}", pickle.dumps(value))
    out = [value if p == me else pickle.loads(_wait(client, f"{key}/{p}")) for p in range(count)]  # noqa: S301
    if client.key_value_increment(f"{key}/read", 1) == count:
        client.key_value_delete(key)  # the last to read them all
    return out


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multihost.broadcast needs jax.distributed to be initialized")
    return client


def _wait(client: Any, key: str) -> bytes:
    """``key``'s value once the lead wrote it, however long the lead is idle."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, _WAIT_MS)
        except Exception as e:  # noqa: BLE001 - jaxlib raises a bare XlaRuntimeError
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def shutdown(cfg: DistributedConfig) -> None:
    """Leaves the job (a barrier: every process waits for the others)."""
    if cfg.enabled:
        import jax

        jax.distributed.shutdown()
