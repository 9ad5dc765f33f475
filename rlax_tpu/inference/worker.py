"""``InferenceWorker``: the passive inference component (in-process API; ``service.py`` serves it
over gRPC with the same calls).

    worker = InferenceWorker(model, cfg.inference, weight_source=source)
    for rollout in worker.generate([Request(prompt_id="p0", prompt_tokens=ids, num_samples=8)]):
        ...                                   # streamed as samples finish; G per request
    worker.load_weights(3)                    # between engine steps; in-flight samples come back
    worker.status(); worker.shutdown()        # to their generate streams as ABORTED

The worker only works for its callers: one engine thread steps while some ``generate`` call has
unfinished samples and sleeps otherwise. Every sample of every accepted request comes back
exactly once: finished, or ABORTED (weight reload without ``continue_on_reload``, shutdown).

Several hosts (a ``jax.distributed`` job whose engine mesh spans its processes): process 0 runs
the worker and serves callers; every other process runs a :class:`Follower`, which repeats the
lead's engine calls (``lockstep``) and pulls each weight version from its own weight source (each
process only the slices its devices hold). A version some process could not pull is loaded by
none (the caller gets UnknownVersion naming it); any other failure of any process ends every
process (``rlax_tpu.multihost``), where one process's worker fails its callers and goes on.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

from rlax_tpu import models, multihost
from rlax_tpu.config import InferenceConfig, RunConfig
from rlax_tpu.inference import lockstep
from rlax_tpu.inference.engine import Engine, EngineStats, InvalidRequest
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.standby import Standby
from rlax_tpu.observability.profiles import PROFILER
from rlax_tpu.types import Rollout


class UnknownVersion(LookupError):
    """The weight source has no such version."""


class VersionMismatch(RuntimeError):
    """A generate call asked for a version the worker does not hold."""


class WorkerShutdown(RuntimeError):
    """The worker was shut down."""


class WeightSource(Protocol):
    """Where versioned weights come from (the parameter server in production; the controller
    wires a client in). ``fetch`` returns the model's parameters as an ``nnx.State`` or its pure
    dict, and raises ``UnknownVersion`` (or ``KeyError``) for a version it does not have."""

    def fetch(self, version: int) -> Any: ...


class DictWeightSource:
    """Versions held in memory: {version: params}."""

    def __init__(self, versions: dict[int, Any] | None = None):
        self.versions = dict(versions or {})

    def fetch(self, version: int) -> Any:
        if version not in self.versions:
            raise UnknownVersion(f"no weights for version {version}; have {sorted(self.versions)}")
        return self.versions[version]


@dataclasses.dataclass(frozen=True)
class WorkerStatus(EngineStats):
    backend: str
    serving: bool


@dataclasses.dataclass
class _Route:
    stream: queue.Queue
    prompt_id: str  # the caller's
    remaining: int  # samples not yet handed back


@dataclasses.dataclass
class _Load:
    """A weight version waiting for the next lockstep point (multi-process workers)."""

    version: int
    params: Any
    aborted: int | None = None  # samples handed back, once loaded (or refused)
    error: Exception | None = None  # why not: another process could not fetch the version


class InferenceWorker:
    def __init__(
        self,
        model: models.Transformer,
        cfg: InferenceConfig,
        *,
        version: int = 0,
        eos_ids: Collection[int] = (),
        weight_source: WeightSource | None = None,
        devices: list[Any] | None = None,
        run_dir: str = "",
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        """``devices``: the jax devices its engine lays ``cfg.mesh`` out on (default: all).
        ``run_dir``: where its profiles go (:meth:`profile`). ``detokenize``: for requests'
        stop strings (Engine)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.engine = Engine(
            model, cfg, version=version, eos_ids=eos_ids, devices=devices, detokenize=detokenize
        )
        self.weight_source = weight_source
        # The next version, fetched while generating.
        self.standby = Standby(lambda v: _fetch(self.weight_source, v, "worker"))
        # Several processes: this one leads; the engine calls since the last step go to the
        # followers before each step (see lockstep.py).
        self._lockstep = lockstep.is_multi_process()
        self._pending: list[lockstep.Command] = []
        self._loads: list[_Load] = []
        self._standby_waits = False  # for the older weights to go (_release_standby)
        self._cond = threading.Condition()
        self._routes: dict[str, _Route] = {}  # by the internal prompt id given to the engine
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="inference-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: RunConfig, *, weight_source: WeightSource | None = None
    ) -> InferenceWorker:
        """The run's model (``load_model``), served as version 0; EOS ids from its tokenizer when
        it has one."""
        model, eos, detokenize = _model_and_eos(config)
        return cls(
            model,
            config.inference,
            eos_ids=eos,
            weight_source=weight_source,
            run_dir=config.controller.run_dir,
            detokenize=detokenize,
        )

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def weight_bytes_received(self) -> int:
        """Bytes of weights the weight source received over the network so far (this process's;
        a source that does not count them: 0)."""
        return int(getattr(self.weight_source, "bytes_received", 0))

    # -- API ----------------------------------------------------------------------------------

    def generate(
        self, requests: Sequence[Request], *, version: int | None = None
    ) -> Iterator[Rollout]:
        """Queues the requests (all validated first: InvalidRequest, VersionMismatch,
        WorkerShutdown are raised before anything is queued) and yields their rollouts as they
        finish, ``num_samples`` per request."""
        stream: queue.Queue = queue.Queue()
        expected = sum(r.num_samples for r in requests)
        with self._cond:
            if self._stopped:
                raise WorkerShutdown("the inference worker is shut down")
            if version is not None and not self.engine.holds(version):
                raise VersionMismatch(
                    f"requested version {version}, the worker holds {self.engine.version}"
                )
            checked = [self.engine.check_request(r) for r in requests]
            for r in checked:
                key = f"#{next(self._ids)}"
                self._routes[key] = _Route(stream, r.prompt_id, r.num_samples)
                self._call("submit", dataclasses.replace(r, prompt_id=key), version)
            self._cond.notify_all()
        return self._drain(stream, expected)

    @staticmethod
    def _drain(stream: queue.Queue, expected: int) -> Iterator[Rollout]:
        for _ in range(expected):
            item = stream.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def load_weights(self, version: int, params: Any = None) -> int:
        """Serves ``params`` (default: ``weight_source.fetch(version)``) from the next engine step
        on. Returns how many in-flight samples were aborted (handed back to their streams)."""
        if params is not None and self._lockstep:
            raise ValueError(
                "a worker over several processes loads versions from its weight source only "
                "(every process pulls its own copy)"
            )
        if params is None:
            try:
                try:
                    params = self.standby.take(version)
                except KeyError as e:
                    raise UnknownVersion(f"no weights for version {version}") from e
                return self._swap(version, params)
            finally:  # swapped in (or refused): the next staged version may be fetched
                self._release_standby()
        return self._swap(version, params)

    def _release_standby(self) -> None:
        """Lets the next staged version be fetched once the engine holds one version: the
        devices keep two copies at most (the served one and an older one still running, or the
        served one and the standby)."""
        with self._cond:
            self._standby_waits = self.engine.older_version is not None
            if self._standby_waits:
                return
        self.standby.loaded()

    def _swap(self, version: int, params: Any) -> int:
        with self._cond:  # waits for the running step to end
            if self._stopped:
                raise WorkerShutdown("the inference worker is shut down")
            if not self._lockstep:
                aborted = self.engine.load_weights(version, params)
                self._deliver(aborted)
                return len(aborted)
            # Placing weights on a mesh over several processes is a collective: it runs in the
            # engine thread at the next lockstep point, where the followers load too.
            load = _Load(version, params)
            self._loads.append(load)
            self._cond.notify_all()
            while load.aborted is None:
                self._cond.wait()
            if load.error is not None:
                raise load.error
            return load.aborted

    def stage(self, version: int) -> None:
        """Starts fetching ``version`` from the weight source into a standby copy while the
        engine goes on generating; a later ``load_weights(version)`` swaps it in (standby.py).
        With several processes, every follower stages its own copy too."""
        if self.weight_source is None:
            raise UnknownVersion(f"version {version}: this worker has no weight source")
        self.standby.stage(version)
        if self._lockstep:
            with self._cond:  # told to the followers at the next lockstep point
                self._pending.append(("stage", version))

    def profile(self, step: int, *, start: bool) -> None:
        """Starts (``start``) or stops tracing for update ``step`` on every process of this
        worker (observability/profiles.py); the followers at the next lockstep point."""
        if not self.run_dir:
            raise ValueError("this worker has no run directory to write profiles to")
        (PROFILER.start if start else PROFILER.stop)(self.run_dir, step, "inference")
        if self._lockstep:
            with self._cond:
                self._pending.append(("profile", self.run_dir, step, start))

    def status(self) -> WorkerStatus:
        with self._cond:
            stats = self.engine.stats()
        return WorkerStatus(
            **dataclasses.asdict(stats), backend=self.engine.backend, serving=not self._stopped
        )

    def shutdown(self) -> None:
        """Aborts everything in flight (returned as ABORTED) and stops the engine thread."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._deliver(self._call("abort"))
            self._cond.notify_all()
        self._thread.join()

    # -- engine thread --------------------------------------------------------------------------

    def _deliver(self, rollouts: list[Rollout]) -> None:
        for ro in rollouts:
            route = self._routes[ro.prompt_id]
            route.stream.put(dataclasses.replace(ro, prompt_id=route.prompt_id))
            route.remaining -= 1
            if route.remaining == 0:
                del self._routes[ro.prompt_id]

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self.engine.has_work() and not self._loads:
                    self._cond.wait()
                if self._stopped:
                    if self._lockstep:
                        lockstep.broadcast([*self._pending, ("stop",)])
                    for load in self._loads:  # queued before the stop: their callers wait
                        load.error = WorkerShutdown("the inference worker is shut down")
                        load.aborted = 0
                    self._loads.clear()
                    self._cond.notify_all()
                    return
                try:
                    with multihost.bounded("inference step"):  # the followers': lockstep.py
                        if self._lockstep:
                            self._sync()
                        finished = self.engine.step() if self.engine.has_work() else []
                except Exception as e:  # a broken step: fail every waiting caller loudly
                    if self._lockstep:  # the followers may have stepped: end them all
                        multihost.fail(
                            f"inference step failed on process 0: {type(e).__name__}: {e}"
                        )
                    self._fail_all(e)
                    continue
                self._deliver(finished)
                if self._standby_waits and self.engine.older_version is None:
                    self._standby_waits = False
                    self.standby.loaded()

    def _sync(self) -> None:
        """Lockstep point (lead): the followers get this process's engine calls since the last
        one, then every process loads the queued versions (a collective) and steps."""
        loads, self._loads = self._loads, []
        commands = [*self._pending, *(("load", load.version) for load in loads)]
        lockstep.broadcast([*commands, ("step",)])
        self._pending.clear()
        # This process fetched its versions before queueing them; the followers fetch theirs
        # now, and a version one of them lacks is loaded by none (loading is a collective).
        refused = {}
        if loads:  # the followers exchange in the same rounds: those with loads
            refused = lockstep.agree_on_loads([x.version for x in loads], [None] * len(loads))
        for load in loads:
            if load.version in refused:
                load.error = UnknownVersion(
                    f"version {load.version} was not loaded: {refused[load.version]}"
                )
                load.aborted = 0
                continue
            aborted = self.engine.load_weights(load.version, load.params)
            self._deliver(aborted)
            load.aborted = len(aborted)
        self._cond.notify_all()

    def _call(self, kind: str, *args: Any) -> Any:
        """An engine call the followers must repeat (under the condition lock)."""
        self._pending.append((kind, *args))
        if kind == "submit":
            return self.engine.submit(*args)
        aborted = self.engine.abort_all()  # the older weights go with their sequences
        if self._standby_waits:
            self._standby_waits = False
            self.standby.loaded()
        return aborted

    def _fail_all(self, error: Exception) -> None:
        streams = {id(r.stream): r.stream for r in self._routes.values()}.values()
        self._call("abort")
        self._routes.clear()
        for s in streams:
            s.put(RuntimeError(f"inference engine step failed: {error!r}"))


def _model_and_eos(
    config: RunConfig,
) -> tuple[models.Transformer, Collection[int], Callable[[list[int]], str] | None]:
    """The model, its EOS ids and its detokenizer for stop strings (none without a tokenizer)."""
    model = models.load_model(config.model)
    try:
        tokenizer = models.load_tokenizer(config.model)
    except models.ModelLoadError:
        return model, (), None
    return model, tokenizer.stop_ids, tokenizer.text_of


class Follower:
    """A follower process of a multi-host worker: the same engine as the lead's (built at the
    same point of the job, as building it runs collectives), repeating the lead's calls.

        follower = Follower(model, cfg)
        follower.weight_source = PulledWeights(client, follower.engine.weight_shardings())
        follower.run()                        # until the lead shuts down
    """

    def __init__(
        self,
        model: models.Transformer,
        cfg: InferenceConfig,
        *,
        version: int = 0,
        eos_ids: Collection[int] = (),
        weight_source: WeightSource | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        self.engine = Engine(model, cfg, version=version, eos_ids=eos_ids, detokenize=detokenize)
        self.weight_source = weight_source
        self.standby = Standby(lambda v: _fetch(self.weight_source, v, "follower"))

    @classmethod
    def from_config(cls, config: RunConfig) -> Follower:
        model, eos, detokenize = _model_and_eos(config)
        return cls(model, config.inference, eos_ids=eos, detokenize=detokenize)

    def run(self) -> int:
        """Follows until the lead shuts down; returns the engine steps taken."""
        return lockstep.follow(
            self.engine, self.standby.take, stage=self.standby.stage, loaded=self.standby.loaded
        )


def _fetch(source: WeightSource | None, version: int, who: str) -> Any:
    if source is None:
        raise UnknownVersion(f"version {version}: this {who} has no weight source")
    return source.fetch(version)


__all__ = [
    "DictWeightSource",
    "Follower",
    "InferenceWorker",
    "InvalidRequest",
    "Request",
    "UnknownVersion",
    "VersionMismatch",
    "WeightSource",
    "WorkerShutdown",
    "WorkerStatus",
]
