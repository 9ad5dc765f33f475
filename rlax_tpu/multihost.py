"""Joining a ``jax.distributed`` job: one component (an inference worker, the trainer) whose mesh
spans the devices of several hosts, one process per host.

Call :func:`initialize` before anything touches a JAX device: the job's processes agree on the
global device list when they join, and every process then builds the same mesh over it.

One failure rule for the whole job: the processes run the same programs in step, so one that
cannot go on leaves the others waiting in a collective it never enters, or holding another
state. An error on any process therefore ends every process, non-zero, naming the process and
the error, within ``distributed.heartbeat_timeout_s``:

- a process that fails says so (:func:`fail`): every process's watchdog thread waits for that
  word on the host and ends its process, even one blocked in a device collective;
- a process that dies without a word is the coordination service's: it ends every other
  process once the dead one missed its heartbeats ("The following tasks are unhealthy
  (stopped sending heartbeats): <process>"), or at once when the lead, which runs it, died;
- after a call every process made, :func:`agree` compares how it ended everywhere: a call
  that failed on every process is an error of the call (the caller gets it, as from one
  process), one that failed on only some ends the job;
- a process alive but stuck (a hung host, a deadlock) sends its heartbeats and says nothing:
  every call the job's processes run in step (:func:`bounded`: a trainer call, an engine step)
  that has not ended after ``distributed.call_timeout_s`` on a process ends the job from there
  (:func:`fail`): the stuck process's call, or another's waiting for it in a collective.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

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
        jax.distributed.initialize(
            initialization_timeout=cfg.initialization_timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        )
    else:
        jax.distributed.initialize(
            cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.job_process_id(slices),
            initialization_timeout=cfg.initialization_timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
            coordinator_bind_address=coordinator_bind_address(cfg.coordinator_address),
        )
    _timeout_s[0] = cfg.heartbeat_timeout_s
    _call_timeout_s[0] = cfg.call_timeout_s
    if jax.process_count() > 1:
        _stopping.clear()
        watchdog = threading.Thread(target=_watch, name="multihost-watchdog", daemon=True)
        watchdog.start()
        _watchdog[:] = [watchdog]
        if cfg.call_timeout_s > 0:
            progress = threading.Thread(target=_progress, name="multihost-progress", daemon=True)
            progress.start()
            _watchdog.append(progress)
    log.info(
        "joined jax.distributed as process %d of %d (%d local of %d devices)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return jax.process_index() == 0


def coordinator_bind_address(address: str) -> str | None:
    """Where process 0's coordination service listens for ``address`` ("host:port"): the
    address itself when its host is an IP (loopback stays loopback), else None, JAX's default
    of every interface ([::]:port; a DNS name may not be bindable). The service has no
    credentials and its key-value store carries pickled commands, so it must not listen wider
    than the job's own network (DistributedConfig's docstring)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        return f"127.0.0.1:{port}"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


def exchange(value: Any, *, timeout_s: float | None = None, key: str | None = None) -> list[Any]:
    """Every process's picklable ``value``, in process order, on every process. On the host
    (the key-value store), so a process that failed before a device collective can still say
    so and every process decides alike. Every process calls it the same number of times.
    ``timeout_s``: how long to wait for the others (TimeoutError naming the silent ones).
    ``key``: names this exchange instead of its place among the calls (for an exchange on a
    thread of its own, which must not take the place of the main thread's next one); every
    process passes the same, used once."""
    import jax

    if jax.process_count() == 1:
        return [value]
    client, me, count = _client(), jax.process_index(), jax.process_count()
    if key is not None:
        key = f"{_EXCHANGE_PREFIX}/named/{key}"
    else:
        key = f"{_EXCHANGE_PREFIX}/{_exchanges[0]}"
        _exchanges[0] += 1
    client.key_value_set_bytes(f"{key}/{me}", pickle.dumps(value))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out = []
    for p in range(count):
        if p == me:
            out.append(value)
            continue
        try:
            out.append(pickle.loads(_wait(client, f"{key}/{p}", deadline)))  # noqa: S301
        except TimeoutError:
            silent = [q for q in range(p, count) if q != me]
            raise TimeoutError(
                f"processes {silent} did not answer within {timeout_s:g} s"
            ) from None
    if client.key_value_increment(f"{key}/read", 1) == count:
        client.key_value_delete(key)  # the last to read them all
    return out


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multihost.broadcast needs jax.distributed to be initialized")
    return client


def _wait(client: Any, key: str, deadline: float | None = None) -> bytes:
    """``key``'s value once written, however long the writer is idle (TimeoutError past
    ``deadline``, a time.monotonic())."""
    while True:
        wait_ms = _WAIT_MS
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(key)
            wait_ms = max(1, min(wait_ms, int(left * 1000)))
        try:
            return client.blocking_key_value_get_bytes(key, wait_ms)
        except Exception as e:  # noqa: BLE001 - jaxlib raises a bare XlaRuntimeError
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


# -- failures -------------------------------------------------------------------------------
# A process that must end the job writes _FAILURE (the first one's message stands); every
# process's watchdog thread waits for it and ends its own process. The lead runs the key-value
# store: it waits (at most _ACK_S) until each follower has the message before it ends.

EXIT_FAILED = 1  # the entry points' "run failed"
_FAILURE = "rlax/failure"
_ACK = "rlax/failure-ack"
_POLL_MS = 1_000  # the watchdog's wait per read: how long shutdown may wait for it
_ACK_S = 5.0
_GRACE_S = 0.5
_timeout_s = [100]  # distributed.heartbeat_timeout_s, once initialized
_failing = threading.Event()  # this process is ending the job (its watchdog stands aside)
_stopping = threading.Event()  # a clean shutdown (the watchdog returns)
_watchdog: list[threading.Thread] = []


def agree(what: str, error: BaseException | None) -> None:
    """After ``what`` (e.g. "trainer call save"), which every process ran: every process says
    how it ended (``error`` None: it succeeded). Returns when it ended alike everywhere (on
    error the caller raises its own: an error of the call, as from one process). When it
    failed on only some processes they no longer hold the same state: every process ends
    (:func:`fail`), naming them and their errors. A process that failed waits for the others
    at most the heartbeat timeout: they may wait in a collective it never entered."""
    import jax

    if jax.process_count() == 1:
        return
    me = jax.process_index()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    try:
        said = exchange(mine, timeout_s=None if error is None else _timeout_s[0])
    except TimeoutError as e:
        fail(f"{what} failed on process {me}: {mine}; the other {e} (waiting in a collective?)")
    failed = [f"process {p}: {why}" for p, why in enumerate(said) if why is not None]
    if failed and len(failed) < len(said):
        ok = [p for p, why in enumerate(said) if why is None]
        fail(f"{what} failed on {'; '.join(failed)} (it succeeded on processes {ok})")


_call_timeout_s = [0]  # distributed.call_timeout_s, once initialized (0: unbounded)
_current: dict[object, tuple[str, float]] = {}  # this process's calls in step, and their starts


@contextlib.contextmanager
def bounded(what: str) -> Iterator[None]:
    """Runs the body as ``what`` (e.g. "trainer call train_step"), a call every process of the
    job runs in step: if it has not ended after ``distributed.call_timeout_s``, this process
    ends the job naming it (a process of the job is stuck, or this one waits for one that
    is). Nothing for one process or an unbounded timeout."""
    if not _call_timeout_s[0] or not _watchdog:
        yield
        return
    token = object()
    _current[token] = (what, time.monotonic())
    try:
        yield
    finally:
        del _current[token]


def _progress() -> None:
    """The progress watchdog: ends the job when this process's call in step overruns."""
    import jax

    me, limit = jax.process_index(), _call_timeout_s[0]
    while not _stopping.wait(min(1.0, limit / 4)):
        current = min(list(_current.values()), key=lambda c: c[1], default=None)
        if current is not None and time.monotonic() - current[1] > limit:
            fail(
                f"{current[0]} has not ended after {limit} s (distributed.call_timeout_s): a "
                f"process of the job is stuck, or process {me} waits in a collective for one "
                "that is"
            )


def fail(message: str) -> NoReturn:
    """Ends every process of the job with ``message`` (what failed, on which process), this one
    first; exit status EXIT_FAILED. From any thread: the job can no longer run in step."""
    import jax

    _failing.set()
    me, count = jax.process_index(), jax.process_count()
    _say(f"process {me} of {count} ends its job: {message}")
    if count > 1:
        with contextlib.suppress(Exception):  # the store is gone: end anyway
            client = _client()
            # Raises when another process told the job first: its message stands.
            with contextlib.suppress(Exception):
                client.key_value_set(_FAILURE, f"process {me}: {message}")
            _end(client, me, count)
    os._exit(EXIT_FAILED)


def _watch() -> None:
    """The watchdog: ends this process when another one ends the job."""
    import jax

    client, me, count = _client(), jax.process_index(), jax.process_count()
    while not _stopping.is_set():
        try:
            message = client.blocking_key_value_get(_FAILURE, _POLL_MS)
        except Exception as e:  # noqa: BLE001 - jaxlib raises a bare XlaRuntimeError
            if "DEADLINE_EXCEEDED" in str(e):
                continue
            return  # the store is gone: the coordination service ends this process
        if _failing.is_set():
            return  # this process is already ending the job
        _say(f"process {me} of {count} ends: {message}")
        with contextlib.suppress(Exception):
            _end(client, me, count)
        os._exit(EXIT_FAILED)


def _end(client: Any, me: int, count: int) -> None:
    """A follower says it has the message; the lead, whose end takes the store (and, by the
    coordination service, every process still connected) with it, waits for them first."""
    if me != 0:
        client.key_value_set(f"{_ACK}/{me}", "", allow_overwrite=True)
        return
    deadline = time.monotonic() + _ACK_S
    for p in range(1, count):
        with contextlib.suppress(TimeoutError):  # dead, or ending already
            _wait(client, f"{_ACK}/{p}", deadline)
    # A follower ends right after its word: let it, or its coordination client sees the
    # lead gone first and aborts it (exit 134 instead of EXIT_FAILED; it said why either way).
    time.sleep(_GRACE_S)


def _say(line: str) -> None:
    sys.stdout.flush()
    print(f"rlax_tpu: {line}", file=sys.stderr, flush=True)


def shutdown(cfg: DistributedConfig) -> None:
    """Leaves the job (a barrier: every process waits for the others)."""
    if cfg.enabled:
        import jax

        _stopping.set()  # before the client goes: the watchdog reads through it
        for watchdog in _watchdog:
            watchdog.join(timeout=2 * _POLL_MS / 1000)
        jax.distributed.shutdown()
