"""A worker's epochs: the jobs of one version it runs together, in FIFO order of versions, and
the holds that keep an epoch open for later jobs (``WorkerPool.hold``; the pool's docstring says
how the pool uses them).

Overlap (``Epochs(overlap=True)``, a worker that keeps the older weights for the requests that
started on them): the epoch after the head starts once every job of the head has its requests
queued in the worker's engine (``queued``) and no hold keeps the head, instead of waiting for
the head to end. The head is then sealed (no job joins it any more: a job's requests could
reach the worker after their weights were let go), and the epoch after that one waits for the
head to end, so a worker runs two versions at most."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Sequence


class Hold:
    """Keeps the epoch a job within it joined on a worker (``submit(hold=)``) from ending until
    ``release``, so its later jobs there run in it, ahead of epochs queued since.

    Holds are ordered by creation (``seq``). An epoch kept only by holds, with no job of its
    own running, gives way to a job of an older hold waiting behind it (its younger holds'
    later jobs there open a new epoch): every wait is then on a running job or an older hold,
    so holds never wait for each other in a cycle (a failover can place a hold's job behind a
    younger hold's epoch)."""

    _count = itertools.count()

    def __init__(self, version: int, epochs: Sequence[Epochs]):
        self.version, self._epochs = version, epochs
        self.seq = next(Hold._count)
        self._kept: dict[int, Epoch] = {}  # worker -> the epoch kept there
        self._lock = threading.Lock()
        self._released = False

    def join(self, i: int) -> Epoch:
        """The epoch a job on worker ``i`` within the hold runs in (kept from now on)."""
        with self._lock:
            if self._released:
                raise RuntimeError(f"a job submitted within a released hold of {self.version}")
            epoch = self._kept[i] = self._epochs[i].join(self.version, self.seq, self._kept.get(i))
            return epoch

    def release(self) -> None:
        """Lets the kept epochs end once their jobs have (idempotent)."""
        with self._lock:
            kept, self._kept, self._released = self._kept, {}, True
        for i, epoch in kept.items():
            self._epochs[i].unkeep(epoch, self.seq)


class Epoch:
    """Jobs of one version a worker runs together; ``keep``: the holds keeping it open."""

    def __init__(self, version: int):
        self.version, self.jobs = version, 0
        self.unqueued = 0  # jobs whose requests are not queued in the worker's engine yet
        self.sealed = False  # the next epoch started beside it: no job joins it
        self.keep: set[int] = set()
        self.held_jobs: collections.Counter[int] = collections.Counter()  # hold seq -> jobs


class Epochs:
    """Per-worker FIFO of version epochs: jobs of the head epoch run, later epochs wait."""

    def __init__(self, exclusive: bool = False, overlap: bool = False) -> None:
        if exclusive and overlap:
            raise ValueError("exclusive epochs run one job at a time; overlap runs two epochs")
        self.exclusive = exclusive  # every job (every hold) is an epoch of its own
        self.overlap = overlap  # the next epoch starts beside a head whose jobs are all queued
        self._cond = threading.Condition()
        self._queue: list[Epoch] = []
        self._closed = False
        self.load_lock = threading.Lock()

    def join(
        self,
        version: int,
        hold: int | None = None,
        kept: Epoch | None = None,
        *,
        ahead: bool = False,
    ) -> Epoch:
        """The epoch a job of ``version`` runs in: ``kept`` (its hold's, while still open),
        else (not in exclusive mode) the last one if of the same version, or with ``ahead``
        the first one of that version, else a new one."""
        with self._cond:
            same = (
                []
                if self.exclusive
                else [e for e in self._queue if e.version == version and not e.sealed]
            )
            if kept is not None and kept in self._queue and hold in kept.keep:
                epoch = kept
            elif ahead and same:
                epoch = same[0]
            elif same and same[-1] is self._queue[-1]:
                epoch = same[-1]
            else:
                epoch = Epoch(version)
                self._queue.append(epoch)
            epoch.jobs += 1
            epoch.unqueued += 1
            if hold is not None:
                epoch.keep.add(hold)
                epoch.held_jobs[hold] += 1
            self._settle()
            return epoch

    def wait_turn(self, epoch: Epoch) -> bool:
        """Waits for ``epoch`` to be the head, or with overlap the one after a head whose jobs
        are all queued and that no hold keeps (the head is sealed then); False: the pool closed
        first."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._may_run(epoch))
            if not self._closed and self._queue[0] is not epoch:
                self._queue[0].sealed = True
            return not self._closed

    def _may_run(self, epoch: Epoch) -> bool:
        head = self._queue[0]
        if head is epoch:
            return True
        return (
            self.overlap
            and len(self._queue) > 1
            and self._queue[1] is epoch
            and epoch.version > head.version  # forward only: a reload back drains
            and (head.sealed or (head.unqueued == 0 and not head.keep))
        )

    def queued(self, epoch: Epoch) -> None:
        """A job of ``epoch`` has its requests queued in the worker's engine."""
        with self._cond:
            epoch.unqueued -= 1
            self._cond.notify_all()

    def leave(self, epoch: Epoch, hold: int | None = None, *, queued: bool = True) -> None:
        """A job of ``epoch`` ended (``queued`` False: before its requests were queued)."""
        with self._cond:
            epoch.jobs -= 1
            epoch.unqueued -= int(not queued)
            if hold is not None:
                epoch.held_jobs[hold] -= 1
            self._settle()
            self._cond.notify_all()  # the next epoch may overlap now

    def unkeep(self, epoch: Epoch, hold: int) -> None:
        with self._cond:
            epoch.keep.discard(hold)
            self._settle()
            self._cond.notify_all()  # the next epoch may overlap now

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _settle(self) -> None:
        """Ends the head while it has no job and no hold keeps it; a head kept by holds alone
        gives way to jobs of older holds waiting behind it. Holds _cond."""
        while self._queue:
            head = self._queue[0]
            if head.jobs == 0 and head.keep:
                waiting = [h for e in self._queue[1:] for h, n in e.held_jobs.items() if n > 0]
                if waiting:
                    head.keep = {h for h in head.keep if h < min(waiting)}
            if head.jobs or head.keep:
                return
            self._queue.pop(0)
            self._cond.notify_all()
