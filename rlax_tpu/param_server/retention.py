"""Which hot versions may be garbage-collected (RLAX §3: GC of versions before v happens only once
every replica has confirmed progress to v), and which a consumer still holds (leases).

Replicas add availability, so a dead replica must not hold GC back for ever: every report of a
replica's progress is a lease on its say in GC. A replica whose progress was not reported again
within ``replica_lease_s`` (it is down, or partitioned from the trainer that reports it) stops
counting until its next report; a replica never heard of counts from this server's start for one
lease (a replica that boots a little later is waited for). A replica the trainer saw miss a version
(down, or refusing it) stops counting at once: it would catch up by later pushes, not from the
versions its peers keep. This replica's own progress never lapses (it is what it holds). Reports
come with the trainer's pushes, so when pushes are further apart than the lease every peer has
lapsed by the next commit and each replica collects by its own progress: harmless while the
replicas take the same versions, and a replica that missed some is one whose progress should not
hold GC back.

Pure bookkeeping, no I/O; the caller serializes access.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from rlax_tpu.param_server.errors import InvalidArgument


class Retention:
    """Replica progress and consumer leases.

    Progress of replica r is the newest version r has committed (monotone), live until its lease
    ends. Version v is collectible when every replica with live progress (and every one never
    heard of, during the first lease after the start) has progress > v, and no live consumer lease
    holds v. A consumer's lease is its full set of held versions, renewed by setting it again; it
    lapses after its TTL so a dead consumer cannot pin memory for ever.
    """

    def __init__(
        self,
        *,
        replicas: int,
        own: int = 0,
        replica_lease_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.replicas, self.own, self.replica_lease_s = replicas, own, replica_lease_s
        self._clock = clock
        self._started = clock()
        self._progress: dict[int, tuple[int, float]] = {}  # replica -> (version, lease expiry)
        self._leases: dict[str, tuple[frozenset[int], float]] = {}  # consumer -> (versions, expiry)

    def report_progress(self, replica: int, version: int) -> None:
        """Replica ``replica`` has committed ``version``; renews its lease."""
        if not 0 <= replica < self.replicas:
            raise InvalidArgument(f"replica {replica} is not in [0, {self.replicas})")
        if version < 0:
            raise InvalidArgument(f"progress version must be >= 0, got {version}")
        before = self._progress.get(replica, (-1, 0.0))[0]
        expiry = math.inf if replica == self.own else self._clock() + self.replica_lease_s
        self._progress[replica] = (max(version, before), expiry)

    def missed(self, replica: int) -> None:
        """Replica ``replica`` did not take a version its peers committed: its lease ends now
        (its progress stays on record), so it holds GC back again only once reported again.
        This replica's own progress is kept."""
        if not 0 <= replica < self.replicas:
            raise InvalidArgument(f"replica {replica} is not in [0, {self.replicas})")
        if replica != self.own:
            self._progress[replica] = (self._progress.get(replica, (-1, 0.0))[0], -math.inf)

    def progress(self) -> dict[int, int]:
        """Every replica's newest reported version (lapsed or not)."""
        return {r: v for r, (v, _) in self._progress.items()}

    def counted(self) -> list[int]:
        """Replicas whose progress holds GC back now: a live lease, or never heard of during the
        first lease after the start."""
        now = self._clock()
        first = now < self._started + self.replica_lease_s
        return [
            r
            for r in range(self.replicas)
            if (r in self._progress and self._progress[r][1] > now)
            or (r not in self._progress and first)
        ]

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
        lagging = [r for r in self.counted() if self._progress.get(r, (-1, 0.0))[0] <= version]
        if lagging:
            return f"replicas {lagging} have not confirmed progress past version {version}"
        holders = self.holders(version)
        if holders:
            return f"version {version} is leased by {', '.join(holders)}"
        return None
