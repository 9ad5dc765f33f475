"""Versions handed from the trainer to the inference workers of the same process, device to device.

One process holding the trainer and the workers (the local transport with the trainer in
process: a single TPU VM's chips split by ``topology.trainer_devices``, or a CPU run) moves a
version with one ``jax.device_put`` of the trainer's published cast onto a worker's shardings:
over ICI on a TPU VM, with no host copy and no gRPC on the path from the trainer to the engine.

The parameter server still gets every version, from a background thread (a host copy and a
gRPC push off that path): workers asking for a version the hand-off no longer holds, the
controller's version list and a resumed run read it there. The controller's leases of versions
still being copied are set once their copies land. At most ``max_pending`` copies wait
at once; a trainer that publishes faster waits for the oldest (bounded versions in flight), and
a copy that failed is raised by the next push or flush.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from rlax_tpu.controller.ports import ParamServerPort

if TYPE_CHECKING:
    from rlax_tpu.inference.worker import WeightSource
    from rlax_tpu.trainer.trainer import WeightSink

log = logging.getLogger(__name__)


class DeviceHandoff:
    """The trainer's weight sink (``push``) and, per worker, a weight source (``source``).

    ``keep``: the newest versions held on the trainer's devices (each costs one published copy
    of the trainer's memory); older ones come from ``copy_to`` (the parameter-server client).
    """

    def __init__(self, copy_to: WeightSink, *, keep: int = 1, max_pending: int = 1):
        if keep < 1 or max_pending < 1:
            raise ValueError(f"keep ({keep}) and max_pending ({max_pending}) must be >= 1")
        self.copy_to, self.keep, self.max_pending = copy_to, keep, max_pending
        self._held: dict[int, Any] = {}  # version -> the published tree (jax arrays)
        self._queue: list[tuple[int, Any]] = []  # copies to the parameter server, in order
        self._copying: int | None = None  # the version the thread is copying
        # key -> a call run once no copy is pending (a consumer's lease)
        self._after: dict[str, Callable[[], Any]] = {}
        self._failed: dict[int, BaseException] = {}  # version -> why its copy failed
        self._closed = False
        self._cond = threading.Condition()
        self.counts = {"device_loads": 0, "server_loads": 0, "copies": 0}
        self._thread = threading.Thread(target=self._copy_loop, name="handoff-copy", daemon=True)
        self._thread.start()

    # -- the trainer's side ------------------------------------------------------------------

    def push(self, params: Any, version: int) -> None:
        """Holds ``params`` (the published cast: nested dict of jax arrays the trainer no longer
        writes) as ``version`` and queues its copy to the parameter server."""
        with self._cond:
            self._raise_failed()
            while len(self._pending()) >= self.max_pending and not (self._failed or self._closed):
                self._cond.wait()
            self._raise_failed()
            self._held[version] = params
            for old in sorted(self._held)[: -self.keep]:
                del self._held[old]
            self._queue.append((version, params))
            self._cond.notify_all()

    def flush(self, version: int | None = None) -> None:
        """Waits until every pushed version (or ``version``) is on the parameter server; raises
        the failure of a copy (of ``version``'s)."""
        with self._cond:
            if version is None:
                while self._pending() and not (self._failed or self._closed):
                    self._cond.wait()
                self._raise_failed()
                return
            while version in self._pending() and not self._closed:
                self._cond.wait()
            if version in self._failed:
                self._raise_failed(version)

    def pending(self) -> set[int]:
        """The versions pushed here and not yet on the parameter server."""
        with self._cond:
            return self._pending()

    def _pending(self) -> set[int]:
        return {v for v, _ in self._queue} | ({self._copying} - {None})

    def after_copies(self, call: Callable[[], Any], *, key: str = "") -> None:
        """Runs ``call`` once every version pushed so far is on the parameter server (at once if
        none is pending); a later call of the same ``key`` replaces one still waiting. Its
        failure is logged."""
        with self._cond:
            if self._pending():
                self._after[key] = call
                return
        _logged(call)

    def drop_after(self, key: str) -> None:
        """Forgets the call of ``key`` still waiting for copies (a newer one replaced it)."""
        with self._cond:
            self._after.pop(key, None)

    def held(self) -> list[int]:
        with self._cond:
            return sorted(self._held)

    def _raise_failed(self, version: int | None = None) -> None:
        if self._closed:
            raise RuntimeError("the weight hand-off is closed")
        if version is None and self._failed:
            version = min(self._failed)
        if version is not None and version in self._failed:
            error = self._failed[version]
            raise RuntimeError(
                f"copying version {version} to the parameter server failed: {error}"
            ) from error

    def _copy_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                version, params = self._queue.pop(0)
                self._copying = version
            try:
                self.copy_to.push(params, version)
                failure = None
            except BaseException as e:  # noqa: BLE001 - handed to the trainer's next push
                log.error("copying version %d to the parameter server failed: %s", version, e)
                failure = e
            params = None  # the hand-off's own hold decides how long the arrays live
            while True:  # the deferred call runs before the copy counts as done (flush waits)
                with self._cond:
                    after = None
                    if failure is None and not self._queue and self._after:
                        after = self._after.pop(next(iter(self._after)))
                    else:
                        self._copying = None
                        self.counts["copies"] += failure is None
                        if failure is not None:
                            self._failed[version] = failure
                        self._cond.notify_all()
                        break
                _logged(after)

    # -- the workers' side -------------------------------------------------------------------

    def source(self, shardings: Any, fallback: WeightSource) -> HandedWeights:
        """A worker's weight source: versions held here go onto ``shardings`` (the engine's
        ``weight_shardings()``) device to device, the others come from ``fallback``."""
        return HandedWeights(self, shardings, fallback)

    def _take(self, version: int) -> Any | None:
        with self._cond:
            tree = self._held.get(version)
            self.counts["device_loads" if tree is not None else "server_loads"] += 1
            return tree

    def port(self, param_server: ParamServerPort) -> FlushedPort:
        """``param_server`` as the controller sees it: what it lists includes every version
        pushed here (their copies are waited for first)."""
        return FlushedPort(self, param_server)

    def close(self) -> None:
        """Stops the copy thread after the copy under way (the queued ones are dropped: the local
        parameter server they go to stops with the run)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=60)
        with self._cond:
            self._held.clear()


class HandedWeights:
    """A worker's weight source over a ``DeviceHandoff`` (``fetch(version)``)."""

    def __init__(self, handoff: DeviceHandoff, shardings: Any, fallback: WeightSource):
        self.handoff, self.shardings, self.fallback = handoff, shardings, fallback

    @property
    def bytes_received(self) -> int:
        """Bytes received over the network so far: the fallback's pulls (a hand-off sends none)."""
        return getattr(self.fallback, "bytes_received", 0)

    def fetch(self, version: int) -> Any:
        tree = self.handoff._take(version)
        if tree is None:
            self.handoff.flush(version)  # a version pushed here is on the parameter server first
            return self.fallback.fetch(version)
        return jax.block_until_ready(jax.device_put(tree, self.shardings))


class FlushedPort:
    """The parameter server's controller port, its version list taken after the pending copies."""

    def __init__(self, handoff: DeviceHandoff, param_server: ParamServerPort):
        self.handoff, self.param_server = handoff, param_server

    def list_versions(self) -> tuple[list[Any], int | None]:
        self.handoff.flush()
        return self.param_server.list_versions()

    def lease(self, consumer: str, versions: Sequence[int], ttl_s: float = 0.0) -> float:
        """Leases ``versions`` (replacing the consumer's set); those still being copied are
        leased with the rest once their copies land, the others at once."""
        pending = self.handoff.pending()
        ready = [v for v in versions if v not in pending]
        # An empty set releases the consumer's lease: passed on as it is.
        out = self.param_server.lease(consumer, ready, ttl_s) if ready or not versions else ttl_s
        if len(ready) < len(versions):  # after the partial lease: the whole set lands last
            self.handoff.after_copies(
                lambda: self.param_server.lease(consumer, list(versions), ttl_s), key=consumer
            )
        else:  # this set replaces one still waiting for its copies
            self.handoff.drop_after(consumer)
        return out


def _logged(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - a lease is an optimization of GC
        log.warning("a deferred parameter-server call failed: %s", e)
