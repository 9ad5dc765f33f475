"""Which hot versions may be garbage-collected (RLAX §3: GC of versions before v happens only once
every replica has confirmed progress to v), and which a consumer still holds (leases).

Pure bookkeeping, no I/O; the caller serializes access.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rlax_tpu.param_server.errors import InvalidArgument


class Retention:
    """Replica progress and consumer leases.

    Progress of replica r is the newest version r has committed (monotone). Version v is
    collectible when every one of the ``replicas`` replicas has progress > v and no live lease
    holds v. A lease is a consumer's full set of held versions, renewed by setting it again;
    it lapses after its TTL so a dead consumer cannot pin memory forever.
    """

    def __init__(self, *, replicas: int, clock: Callable[[], float] = time.monotonic):
        self.replicas = replicas
        self._clock = clock
        self._progress: dict[int, int] = {}
        self._leases: dict[str, tuple[frozenset[int], float]] = {}  # consumer -> (versions, expiry)

    def report_progress(self, replica: int, version: int) -> None:
        if not 0 <= replica < self.replicas:
            raise InvalidArgument(f"replica {replica} is not in [0, {self.replicas})")
        if version < 0:
            raise InvalidArgument(f"progress version must be >= 0, got {version}")
        self._progress[replica] = max(version, self._progress.get(replica, -1))

    def progress(self) -> dict[int, int]:
        return dict(self._progress)

    def set_lease(self, consumer: str, versions: Iterable[int], ttl_s: float) -> None:
        """Replaces ``consumer``'s lease; an empty set releases it. ``ttl_s=inf``: no expiry."""
        if not consumer:
            raise InvalidArgument("a lease needs a consumer name")
        if not ttl_s > 0:
            raise InvalidArgument(f"lease ttl_s must be > 0, got {ttl_s}")
        held = frozenset(versions)
        if held:
            self._leases[consumer] = (held, self._clock() + ttl_s)
        else:
            self._leases.pop(consumer, None)

    def holders(self, version: int) -> list[str]:
        """Consumers with a live lease on ``version`` (lapsed leases are dropped here)."""
        now = self._clock()
        self._leases = {c: (v, t) for c, (v, t) in self._leases.items() if t > now}
        return sorted(c for c, (held, _) in self._leases.items() if version in held)

    def blocker(self, version: int) -> str | None:
        """Why ``version`` may not be collected yet, or None when it may."""
        lagging = [r for r in range(self.replicas) if self._progress.get(r, -1) <= version]
        if lagging:
            return f"replicas {lagging} have not confirmed progress past version {version}"
        holders = self.holders(version)
        if holders:
            return f"version {version} is leased by {', '.join(holders)}"
        return None
