"""The inference workers as one pool: versioned generation jobs, failover, and rejoin.

A job (version v, requests) is split over the live workers, each request to the one with the
fewest groups outstanding (ties in turn, so small jobs spread too); requests of one session
(``Request.session``: a group's episode turns) go where the session's first request went while
that worker is live, since its engine may still hold the earlier turns' pages. Each worker serves
its jobs in *epochs*: consecutive jobs of one version run concurrently (the engine batches them
continuously); a job of another version waits until the earlier epoch drains, then loads its
weights (a reload between engine steps); the worker is asked to stage that version (fetch it into
a standby copy) as soon as the job arrives, so the load is a swap. With ``overlap`` (throughput
mode, ``inference.overlap_reload``) the next epoch does not wait for the earlier one to drain:
it loads once every job of the earlier one is queued in the engine, which finishes those on the
older weights beside the new version's (``epochs.py``: two versions at most). A *hold* (``hold(version)``: a job's episodes) keeps the epoch its
first job joined on a worker open until released: the jobs submitted within it (the episodes'
later turns) run in that epoch, ahead of the epochs queued since (other versions', and in
exclusive mode every other job's), so an episode's kept pages are used and its worker does not
reload back and forth; a kept epoch with no job running gives way to an older hold's job
waiting behind it (``Hold``). A worker that fails
(unreachable, shut down, an RPC error) is marked down and its share goes to another live worker;
a down worker is probed before each job and takes work again once it answers. Aborted samples are
generated again: with per-group seeds that gives the same tokens, so failover does not change
results.

Partial rollouts (``continue_on_reload``, throughput mode): a job of a newer version reloads its
worker at once instead of waiting for the running jobs, which continue under the new weights (the
engine records each token's version; a rollout's staleness is its oldest token's). A job of an
older version runs on the newer weights the worker already holds.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
import zlib
from collections.abc import Callable, Sequence

from rlax_tpu.controller.epochs import Epoch, Epochs, Hold
from rlax_tpu.controller.ports import InferencePort
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.types import FinishReason, Rollout

log = logging.getLogger(__name__)

_SESSIONS = 1 << 16  # sessions remembered (oldest forgotten: their requests go round-robin)
# Generation calls at once (threads start as needed): shares of every worker's slots, and
# shares waiting for their worker's epoch, each hold one.
_MAX_CALLS = 4096
_PUBLISHED_TRACKED = 64  # versions awaiting every worker's load (older ones forgotten)


class NoWorkers(RuntimeError):
    """Every inference worker is down."""


class PoolClosed(RuntimeError):
    """The pool was closed while a job waited for a worker to come back."""


class WorkerPool:
    def __init__(
        self,
        workers: Sequence[InferencePort],
        *,
        names: Sequence[str] | None = None,
        retry_s: float = 60.0,
        on_event: Callable[[str], None] | None = None,
        exclusive_jobs: bool = False,
        continue_on_reload: bool = False,
        overlap: bool = False,
    ):
        """``exclusive_jobs``: a worker runs one job at a time, so the engine's batches (and with
        them its scheduling, preemptions and sampled tokens) depend on the job alone, never on
        timing: deterministic mode needs this; throughput mode shares the engine."""
        if not workers:
            raise ValueError("the pool needs at least one inference worker")
        if exclusive_jobs and continue_on_reload:
            raise ValueError("continue_on_reload reloads under running jobs; exclusive jobs never")
        self.continue_on_reload = continue_on_reload
        self.workers = list(workers)
        self.names = list(names or [f"worker {i}" for i in range(len(workers))])
        self.retry_s = retry_s
        self._on_event = on_event or (lambda text: log.warning("%s", text))
        self._held: list[int | None] = [None] * len(workers)  # version each worker holds
        self._staged: list[int | None] = [None] * len(workers)  # last version asked to stage
        # version -> (when the trainer published it, the workers that serve it since)
        self._published: collections.OrderedDict[int, tuple[float, set[int]]] = (
            collections.OrderedDict()
        )
        self._publish_to_serve: list[float] = []
        self._wire_seen: dict[int, int] = {}  # worker -> its weight_bytes_received at its last load
        self._down: set[int] = set()
        self._lock = threading.Lock()
        self._epochs = [Epochs(exclusive_jobs, overlap) for _ in workers]
        # A thread per share being generated or waiting for its epoch (a worker runs several
        # shares at once in throughput mode): a small cap would idle workers' slots at scale.
        self._threads = cf.ThreadPoolExecutor(_MAX_CALLS, "gen")
        self._coordinator = cf.ThreadPoolExecutor(_MAX_CALLS, "gen-jobs")
        self._outstanding = [0] * len(workers)  # groups given to each worker, not yet back
        self._rotation = 0  # where the search for the least-loaded worker starts
        self.generated_tokens = 0
        self._times = dict.fromkeys(
            ("load_s", "loads", "wire_bytes", "generate_s", "calls", "groups")
            + ("eval_generate_s", "eval_calls", "eval_loads"),  # evaluations beside training
            0.0,
        )
        # Set by close(): a job waiting for a worker to come back gives up at once (a stopped
        # controller must not outlive its SIGTERM by the retry window).
        self._closing = threading.Event()
        # session -> the worker its first request went to (its engine may keep the pages).
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()

    @property
    def live(self) -> list[int]:
        with self._lock:
            return [i for i in range(len(self.workers)) if i not in self._down]

    def submit(
        self,
        version: int,
        requests: Sequence[Request],
        *,
        counted: bool = True,
        hold: Hold | None = None,
        on_group: Callable[[list[Rollout]], None] | None = None,
        ahead: bool = False,
    ) -> cf.Future[list[Rollout]]:
        """Generates every request with weights ``version``; the future holds all rollouts.
        ``counted`` False: the requests do not count in the load balance (evaluations beside
        training: where training's requests go must not depend on when they finish).
        ``hold`` (of ``version``): the job runs in the hold's epoch on each worker.
        ``on_group``: called (on a pool thread) with each request's rollouts as soon as all of
        them are generated, before the job ends; a group a failed worker had finished may be
        passed again (the same tokens, generated again elsewhere). ``ahead`` (outside exclusive
        mode): the job joins the first epoch of ``version`` queued on its worker, ahead of newer
        ones (an evaluation of a version training has moved past: no reload back to it)."""
        if hold is not None and hold.version != version:
            raise ValueError(f"a hold of version {hold.version} used for a job of {version}")
        self._probe_down()
        live = self.live or list(range(len(self.workers)))
        shares: dict[int, list[Request]] = {i: [] for i in live}
        extra = [0] * len(self.workers)  # uncounted requests still spread over the workers
        with self._lock:
            for r in requests:
                i = self._sessions.get(r.session) if r.session else None
                if i not in shares:
                    i = self._least_loaded(live, None if counted else extra)
                    if r.session:
                        self._sessions[r.session] = i
                        while len(self._sessions) > _SESSIONS:
                            self._sessions.popitem(last=False)
                shares[i].append(r)
                self._outstanding[i] += int(counted)
                extra[i] += int(not counted)
        job = _Job(version, counted, hold, on_group, ahead)
        futures = {i: self._start(i, job, reqs) for i, reqs in shares.items() if reqs}
        return self._coordinator.submit(self._gather, job, futures)

    def hold(self, version: int) -> Hold:
        """A hold of ``version``'s epochs for the jobs submitted within it (``submit(hold=)``);
        release it (``Hold.release``) when its last job has ended."""
        return Hold(version, self._epochs)

    def _least_loaded(self, live: list[int], extra: Sequence[int] | None = None) -> int:
        """The live worker with the fewest groups outstanding (plus ``extra``: this job's
        uncounted ones); ties go round-robin (a job of fewer groups than workers does not
        always land on the first ones). Holds _lock."""
        n = len(live)
        order = [live[(self._rotation + j) % n] for j in range(n)]
        i = min(order, key=lambda w: self._outstanding[w] + (extra[w] if extra else 0))
        if extra is None:  # uncounted requests leave training's turn where it was
            self._rotation = (live.index(i) + 1) % n
        return i

    def _start(self, i: int, job: _Job, requests: list[Request]) -> cf.Future:
        groups = len(requests) if job.counted else 0
        if self.continue_on_reload:
            try:
                fut = self._threads.submit(self._run_continuing, i, job, requests)
            except BaseException:
                self._returned(i, groups)
                raise
        else:
            hold = job.hold.seq if job.hold is not None else None
            try:
                epoch = job.hold.join(i) if job.hold is not None else None
            except BaseException:  # a released hold: nothing joined
                self._returned(i, groups)
                raise
            if epoch is None:
                epoch = self._epochs[i].join(job.version, ahead=job.ahead)
            try:
                self._stage_ahead(i, job.version)
                fut = self._threads.submit(self._run_in_epoch, i, epoch, hold, job, requests)
            except BaseException:  # closed: the epoch must not wait for a job never started
                self._epochs[i].leave(epoch, hold, queued=False)
                self._returned(i, groups)
                raise
        fut.add_done_callback(lambda _: self._returned(i, groups))
        return fut

    def stage(self, version: int, *, holding: int) -> None:
        """Has every live worker that holds version ``holding`` (the reload point before)
        fetch ``version`` ahead (one still being pushed, relayed as it arrives: the fetch
        overlaps the push), so that its epoch's load is a swap. Workers at another version
        are left to stage it with their jobs: one that loads an older version first would hold
        the served weights, this copy and that one."""
        for i in self.live:
            with self._lock:
                held = self._held[i]
            if held == holding:
                self._stage_ahead(i, version)

    def _stage_ahead(self, i: int, version: int) -> None:
        """Has worker i fetch ``version`` while it still generates the earlier epoch's jobs, so
        the epoch's load is a swap (a worker without ``stage`` fetches at the load)."""
        stage = getattr(self.workers[i], "stage", None)
        with self._lock:
            if stage is None or version in (self._held[i], self._staged[i]):
                return
            self._staged[i] = version

        def call() -> None:
            try:
                stage(version)
            except Exception as e:  # noqa: BLE001 - the load fetches it then, or fails loudly
                log.info("%s could not stage version %d: %s", self.names[i], version, e)

        self._threads.submit(call)

    def _returned(self, i: int, groups: int) -> None:
        with self._lock:
            self._outstanding[i] -= groups

    def _run_continuing(
        self, i: int, job: _Job, requests: list[Request]
    ) -> tuple[list[Request], list[Rollout], Exception | None]:
        with self._epochs[i].load_lock:
            held = self._held[i]
            if held is None or held < job.version:
                try:
                    self._load(i, job.version, job.counted)
                except Exception as e:
                    self._held[i] = None
                    return self._fail(i, requests, [], e)
                self._held[i] = job.version
        # No version pinned: a newer job may reload the worker while this one runs.
        return self._run(i, None, requests, job)

    def _run_in_epoch(
        self, i: int, epoch: Epoch, hold: int | None, job: _Job, requests: list[Request]
    ) -> tuple[list[Request], list[Rollout], Exception | None]:
        epochs = self._epochs[i]
        queued = [False]

        def on_queued() -> None:
            queued[0] = True
            epochs.queued(epoch)

        try:
            if not epochs.wait_turn(epoch):
                return requests, [], PoolClosed("the pool was closed before this job's turn")
            with epochs.load_lock:  # the epoch's first job loads its weights, the others wait
                if self._held[i] != job.version:
                    try:
                        self._load(i, job.version, job.counted)
                    except Exception as e:
                        self._held[i] = None
                        return self._fail(i, requests, [], e)
                    self._held[i] = job.version
            return self._run(i, job.version, requests, job, on_queued)
        finally:
            epochs.leave(epoch, hold, queued=queued[0])

    def _load(self, i: int, version: int, counted: bool = True) -> None:
        t0 = time.perf_counter()
        self.workers[i].load_weights(version)
        if counted:
            self._count(load_s=time.perf_counter() - t0, loads=1.0)
        else:
            self._count(eval_loads=1.0)
        self._count(wire_bytes=self._wire_bytes(i))
        self._served(i, version)

    def _wire_bytes(self, i: int) -> float:
        """Bytes of weights worker i received over the network since its last load (a worker
        that does not count them: 0; a restarted one counts from 0)."""
        now = getattr(self.workers[i], "weight_bytes_received", None)
        if now is None:
            return 0.0
        last = self._wire_seen.get(i, 0)
        self._wire_seen[i] = now
        return float(now - last if now >= last else now)

    def published(self, version: int, seconds_ago: float = 0.0) -> None:
        """The trainer published ``version`` ``seconds_ago``: from then until every worker
        serves it is its publish-to-serve time (``take_publish_to_serve``)."""
        with self._lock:
            self._published[version] = (time.perf_counter() - seconds_ago, set())
            while len(self._published) > _PUBLISHED_TRACKED:  # never loaded by every worker
                self._published.popitem(last=False)

    def _served(self, i: int, version: int) -> None:
        with self._lock:
            entry = self._published.get(version)
            if entry is None:
                return
            entry[1].add(i)
            if len(entry[1]) == len(self.workers):
                self._publish_to_serve.append(time.perf_counter() - entry[0])
                del self._published[version]

    def take_publish_to_serve(self) -> list[float]:
        """Since the last call: for each version every worker came to serve, the seconds from
        its publication (``published``) to the last worker's load of it."""
        with self._lock:
            out, self._publish_to_serve = self._publish_to_serve, []
        return out

    def _count(self, **amounts: float) -> None:
        with self._lock:
            for k, v in amounts.items():
                self._times[k] += v

    def take_times(self) -> dict[str, float]:
        """Since the last call: seconds the workers spent loading weights (``load_s``, over
        ``loads`` loads, ``wire_bytes`` of weights received over the network by all loads) and generating (``generate_s``, summed over workers, in ``calls``
        generation calls, each a worker's share of a job, for ``groups`` finished groups). The
        planner calibrates its costs on them. Evaluations beside training (uncounted jobs) apart:
        ``eval_generate_s`` over ``eval_calls`` calls and ``eval_loads`` loads."""
        with self._lock:
            out, self._times = self._times, dict.fromkeys(self._times, 0.0)
        return out

    def _gather(self, job: _Job, futures: dict[int, cf.Future]) -> list[Rollout]:
        out: list[Rollout] = []
        pending = collections.deque(futures.items())  # (worker, future); a worker may recur
        deadline = time.monotonic() + self.retry_s
        while pending:
            i, fut = pending.popleft()
            reqs, rollouts, error = fut.result()
            out += rollouts
            if error is None:
                continue
            if isinstance(error, PoolClosed) or self._closing.is_set():
                raise PoolClosed(f"the pool was closed with this job unfinished ({error})")
            live = [j for j in self.live if j != i] or self.live
            while not live:
                if time.monotonic() > deadline:
                    raise NoWorkers(f"every inference worker is down (last error: {error})")
                if self._closing.wait(min(1.0, self.retry_s)):
                    raise PoolClosed(f"closed while every worker was down (last error: {error})")
                self._probe_down()
                live = self.live
            j = live[zlib.crc32(reqs[0].prompt_id.encode()) % len(live)]
            if j != i:
                self._on_event(
                    f"reassigning {len(reqs)} prompt groups from {self.names[i]} to {self.names[j]}"
                )
            with self._lock:
                self._outstanding[j] += len(reqs) if job.counted else 0
            pending.append((j, self._start(j, job, reqs)))
        return out

    def _run(
        self,
        i: int,
        version: int | None,
        requests: list[Request],
        job: _Job,
        on_queued: Callable[[], None] = lambda: None,
    ) -> tuple[list[Request], list[Rollout], Exception | None]:
        """(requests not finished, rollouts of the finished ones, the error if the worker failed).
        ``on_queued`` is called once the worker has queued the requests. Uncounted jobs' seconds
        go to ``eval_generate_s`` and ``eval_calls``."""
        worker = self.workers[i]
        done: list[Rollout] = []
        todo = list(requests)
        try:
            for _attempt in range(3):
                by_key: dict[str, list[Rollout]] = {r.prompt_id: [] for r in todo}
                samples = {r.prompt_id: r.num_samples for r in todo}
                t0 = time.perf_counter()
                stream = worker.generate(todo, version=version)  # returns once queued
                if _attempt == 0:
                    on_queued()
                for ro in stream:
                    got = by_key[ro.prompt_id]
                    got.append(ro)
                    if len(got) == samples[ro.prompt_id]:
                        job.finished(got)
                seconds = time.perf_counter() - t0
                if job.counted:
                    self._count(generate_s=seconds, calls=1.0)
                else:
                    self._count(eval_generate_s=seconds, eval_calls=1.0)
                again = []
                for r in todo:
                    got = by_key[r.prompt_id]
                    if any(ro.finish_reason is FinishReason.ABORTED for ro in got):
                        again.append(r)  # regenerate the whole group: same seeds, same tokens
                    else:
                        done += got
                        with self._lock:
                            self.generated_tokens += sum(len(ro.tokens) for ro in got)
                            self._times["groups"] += job.counted
                todo = again
                if not todo:
                    return [], done, None
            raise RuntimeError(f"{len(todo)} groups aborted three times in a row")
        except Exception as e:  # any failure takes the worker out until it answers again
            return self._fail(i, todo, done, e)

    def _fail(
        self, i: int, todo: list[Request], done: list[Rollout], e: Exception
    ) -> tuple[list[Request], list[Rollout], Exception]:
        with self._lock:
            self._down.add(i)
            self._staged[i] = None  # a restarted worker staged nothing
        self._held[i] = None
        self._on_event(f"inference {self.names[i]} failed and is out of the pool: {e}")
        return todo, done, e

    def _probe_down(self) -> None:
        with self._lock:
            down = sorted(self._down)
        for i in down:
            try:
                self.workers[i].status()
            except Exception:
                continue
            with self._lock:
                self._down.discard(i)
            self._held[i] = None
            self._on_event(f"inference {self.names[i]} answers again and rejoins the pool")

    def close(self, *, wait: bool = False) -> None:
        """Cancels jobs not started and ends waits for a worker to come back; ``wait``: also
        waits for the calls already running."""
        self._closing.set()
        for epochs in self._epochs:  # jobs waiting for their epoch give up
            epochs.close()
        self._coordinator.shutdown(wait=wait, cancel_futures=True)
        self._threads.shutdown(wait=wait, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class _Job:
    version: int
    counted: bool
    hold: Hold | None
    on_group: Callable[[list[Rollout]], None] | None
    ahead: bool = False

    def finished(self, group: list[Rollout]) -> None:
        """Passes a whole group on (``on_group``) unless a sample was aborted (generated again)."""
        if self.on_group is None or any(r.finish_reason is FinishReason.ABORTED for r in group):
            return
        try:
            self.on_group(list(group))
        except Exception:  # the job's result still has the group; the worker did not fail
            log.exception("a job's on_group callback failed")
