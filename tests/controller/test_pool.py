"""The worker pool: versioned jobs over real inference workers, failover and rejoin."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import InferenceConfig
from rlax_tpu.controller.pool import NoWorkers, PoolClosed, WorkerPool
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.worker import DictWeightSource, InferenceWorker

CFG = InferenceConfig(
    max_concurrent_seqs=8,
    page_size=4,
    kv_cache_bytes=2**20,
    prefill_chunk=8,
    max_prompt_len=16,
    max_new_tokens=8,
)


@pytest.fixture(scope="module")
def weights():
    model = models.init_model(models.preset("tiny"))
    v0 = nnx.to_pure_dict(nnx.split(model)[1])
    v1 = jax.tree.map(lambda x: x * 1.01, v0)
    return model, DictWeightSource({0: v0, 1: v1})


@pytest.fixture
def workers(weights):
    model, source = weights
    ws = [InferenceWorker(model, CFG, weight_source=source) for _ in range(2)]
    yield ws
    for w in ws:
        w.shutdown()


class Flaky:
    """A worker that is unreachable while ``down`` is set (as a dead gRPC endpoint would be)."""

    def __init__(self, inner):
        self.inner, self.down, self.calls, self.log = inner, False, 0, []

    def _check(self, what: str = ""):
        self.calls += 1
        self.log.append(what)
        if self.down:
            raise ConnectionError("worker unreachable")

    def generate(self, requests, *, version=None):
        self._check("generate")
        return self.inner.generate(requests, version=version)

    def load_weights(self, version):
        self._check()
        return self.inner.load_weights(version)

    def status(self):
        self._check()
        return self.inner.status()


class LoadsLogged(Flaky):
    """A worker recording the versions it is asked to load, in order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.loads: list[int] = []

    def load_weights(self, version):
        self.loads.append(version)
        return super().load_weights(version)


def requests(n: int) -> list[Request]:
    rng = np.random.default_rng(0)
    return [
        Request(
            prompt_id=f"g{i}",
            prompt_tokens=rng.integers(0, 512, 6).astype(np.int32),
            num_samples=2,
            sampling=SamplingParams(seed=100 + i),
        )
        for i in range(n)
    ]


def tokens(rollouts) -> dict:
    return {(r.prompt_id, r.sample_index): (r.tokens.tolist(), int(r.version)) for r in rollouts}


def test_jobs_carry_their_version_and_results_do_not_depend_on_the_split(workers):
    one = WorkerPool(workers[:1])
    two = WorkerPool(workers)
    try:
        a = one.submit(1, requests(6)).result()
        b = two.submit(1, requests(6)).result()
        c = two.submit(0, requests(6)).result()
    finally:
        one.close(), two.close()
    assert len(a) == 12 and tokens(a) == tokens(b)
    assert {v for _, v in tokens(b).values()} == {1} and {v for _, v in tokens(c).values()} == {0}


def test_a_failing_worker_has_its_work_reassigned_and_rejoins(workers):
    reference = WorkerPool(workers[:1])
    expected = tokens(reference.submit(0, requests(6)).result())
    reference.close()
    flaky = Flaky(workers[0])
    events: list[str] = []
    pool = WorkerPool([flaky, workers[1]], on_event=events.append)
    try:
        flaky.down = True
        got = pool.submit(0, requests(6)).result()
        assert tokens(got) == expected  # nothing lost, same tokens from the other worker
        assert pool.live == [1] and any("reassigning" in e for e in events)
        flaky.down = False
        got = pool.submit(0, requests(6)).result()  # probed before the job: it is back
        assert pool.live == [0, 1] and any("rejoins" in e for e in events)
        assert tokens(got) == expected
    finally:
        pool.close()


def test_closing_the_pool_ends_a_wait_for_workers_to_come_back(workers):
    """A controller stopped (SIGTERM) while every worker is down exits at once, not after the
    retry window: the job waiting for a worker fails with PoolClosed."""
    flaky = Flaky(workers[0])
    flaky.down = True
    pool = WorkerPool([flaky], retry_s=600.0, on_event=lambda e: None)
    job = pool.submit(0, requests(2))
    with pytest.raises(cf.TimeoutError):  # still waiting for the worker (600 s window)
        job.result(timeout=1.0)
    pool.close()
    with pytest.raises(PoolClosed, match="closed while every worker was down"):
        job.result(timeout=30.0)


def test_no_live_worker_is_a_clear_error(workers):
    flaky = Flaky(workers[0])
    flaky.down = True
    pool = WorkerPool([flaky], retry_s=0.5, on_event=lambda e: None)
    try:
        with pytest.raises(NoWorkers, match="every inference worker is down"):
            pool.submit(0, requests(2)).result()
    finally:
        pool.close()


def test_a_sessions_requests_go_to_the_worker_of_its_first_and_reuse_its_pages(workers):
    """An episode's next turns (same ``session``) go where its first turn went, whose engine
    kept that turn's pages; when that worker is out, another takes them (and recomputes)."""
    first = [dataclasses.replace(r, keep_pages=True, session=r.prompt_id) for r in requests(4)]
    flaky = Flaky(workers[0])
    pool = WorkerPool([flaky, workers[1]], on_event=lambda text: None)
    try:
        turns = {(ro.prompt_id, ro.sample_index): ro for ro in pool.submit(0, first).result()}

        def continuations(order):
            return [
                Request(
                    prompt_id=f"{key}.{i}",
                    prompt_tokens=tuple(int(t) for t in turns[key, i].prompt_tokens),
                    continuation=(*turns[key, i].tokens.tolist(), 3),
                    sampling=SamplingParams(seed=7, max_new_tokens=2),
                    session=key,
                )
                for key, i in order
            ]

        # Reversed, so round-robin alone would send each group's turns to the other worker.
        before = [w.status().prefix_tokens_reused for w in workers]
        pool.submit(0, continuations(sorted(turns, reverse=True))).result()
        reused = [w.status().prefix_tokens_reused - b for w, b in zip(workers, before, strict=True)]
        want = [sum(len(ro.prompt_tokens) + len(ro.tokens) - 1 for (k, _), ro in turns.items()
                    if k in ks) for ks in (("g0", "g2"), ("g1", "g3"))]  # fmt: skip
        assert reused == want
        flaky.down = True  # worker 0 out: its sessions go to worker 1
        got = pool.submit(0, continuations(sorted(turns))).result()
        assert len(got) == 8 and pool.live == [1]
    finally:
        pool.close()


def test_the_pool_counts_its_loads_and_generation_since_the_last_take(workers):
    """What the planner calibrates on: loads happen once per worker and version, every
    finished group is counted once, and a take resets the counters."""
    pool = WorkerPool(workers)
    try:
        pool.submit(0, requests(6)).result()
        first = pool.take_times()
        pool.submit(0, requests(4)).result()  # the workers hold version 0 already
        second = pool.take_times()
        pool.submit(1, requests(2)).result()
        third = pool.take_times()
    finally:
        pool.close()
    # Each job's groups spread over both workers: a call each.
    assert (first["loads"], first["calls"], first["groups"]) == (2, 2, 6) and first["load_s"] > 0
    assert (second["loads"], second["load_s"], second["calls"], second["groups"]) == (0, 0, 2, 4)
    assert (third["loads"], third["calls"], third["groups"]) == (2, 2, 2)
    assert all(t["generate_s"] > 0 for t in (first, second, third))
    assert pool.take_times() == dict.fromkeys(first, 0.0)


def test_small_jobs_spread_over_the_workers_by_their_load(workers):
    """Throughput mode submits jobs of a few groups: each goes to the least-loaded worker (ties
    in turn), not always to the first, which left the others idle."""
    flaky = [Flaky(w) for w in workers]
    pool = WorkerPool(flaky)
    try:
        for job in [pool.submit(0, requests(1)) for _ in range(4)]:
            job.result()
    finally:
        pool.close()
    generated = [sum(1 for c in f.log if c == "generate") for f in flaky]
    assert generated == [2, 2]
    assert pool._outstanding == [0, 0]  # every group given out came back


def test_uncounted_requests_spread_and_leave_the_balance_and_the_times_to_training(workers):
    """An evaluation beside training (``counted=False``): its requests still spread over the
    workers, while training's balance never sees them (where a training request goes must
    not depend on when an evaluation's come back), and its seconds are reported apart."""
    flaky = [Flaky(w) for w in workers]
    pool = WorkerPool(flaky, exclusive_jobs=True)
    try:
        with pool._lock:
            seen = []
            real = pool._least_loaded

            def spy(live, extra=None):
                seen.append((list(pool._outstanding), pool._rotation))
                return real(live, extra)

            pool._least_loaded = spy
        pool.submit(0, requests(4), counted=False).result()
        assert seen == [([0, 0], 0)] * 4  # neither the balance nor the turn saw them
        pool.submit(0, requests(2)).result()
    finally:
        pool.close()
    assert [sum(1 for c in f.log if c == "generate") for f in flaky] == [2, 2]
    times = pool.take_times()
    assert times["eval_calls"] == 2 and times["eval_generate_s"] > 0
    assert times["calls"] == 2 and times["groups"] == 2
    assert pool._outstanding == [0, 0]


def test_a_job_of_a_new_version_has_its_worker_stage_it_while_the_last_job_runs(weights):
    """Deterministic mode (one job at a time): the second job's version is fetched into the
    worker's standby copy as soon as the job is queued, and its load takes that copy."""
    model, source = weights
    asked, gate = [], threading.Event()

    class Recording:  # the source, recording each fetch; version 1's waits for the gate
        def fetch(self, version):
            asked.append(version)
            if version == 1:
                assert gate.wait(timeout=60)
            return source.fetch(version)

    worker = InferenceWorker(model, CFG, weight_source=Recording())
    pool = WorkerPool([worker], exclusive_jobs=True)
    try:
        first = pool.submit(0, requests(4))
        pool.published(1)  # the trainer publishes version 1 while the first job runs
        second = pool.submit(1, requests(4))
        deadline = time.monotonic() + 60
        while 1 not in asked and time.monotonic() < deadline:  # staged while the first job runs
            time.sleep(0.01)
        assert asked == [0, 1] and not second.done()
        gate.set()
        assert {v for _, v in tokens(first.result()).values()} == {0}
        assert {v for _, v in tokens(second.result()).values()} == {1}
        # Version 1 from its publication to the (only) worker serving it; version 0 was never
        # published through the pool: not counted.
        served = pool.take_publish_to_serve()
        assert len(served) == 1 and served[0] > 0
        assert pool.take_publish_to_serve() == []
    finally:
        pool.close()
        worker.shutdown()
    assert worker.standby.counts == {"staged": 2, "taken_staged": 2, "fetched_at_load": 0}


def test_an_early_stage_asks_only_the_workers_at_the_reload_point_before(weights):
    """``pool.stage(version, holding=)`` (a version relayed while it is pushed): a worker at
    another version is not asked (it may load that one first: three copies), one at
    ``holding`` fetches it into its standby copy at once."""
    model, source = weights
    asked = []

    class Recording:
        def fetch(self, version):
            asked.append(version)
            return source.fetch(version)

    worker = InferenceWorker(model, CFG, weight_source=Recording())
    pool = WorkerPool([worker], exclusive_jobs=True)
    try:
        pool.submit(0, requests(2)).result()
        pool.stage(1, holding=2)
        time.sleep(0.2)
        assert asked == [0]
        pool.stage(1, holding=0)
        deadline = time.monotonic() + 60
        while asked == [0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked == [0, 1]
        assert {v for _, v in tokens(pool.submit(1, requests(2)).result()).values()} == {1}
    finally:
        pool.close()
        worker.shutdown()
    assert worker.standby.counts["taken_staged"] >= 1 and asked == [0, 1]


def test_a_hold_runs_its_later_jobs_ahead_of_a_newer_version(weights):
    """A step's episodes hold their version's epoch (deterministic mode's exclusive jobs): a
    later turn submitted after a job of a newer version still runs before it, on the kept
    pages, and the worker loads each version once; groups stream out as they finish."""
    model, source = weights
    worker = InferenceWorker(model, CFG, weight_source=source)
    logged = LoadsLogged(worker)
    loads = logged.loads

    pool = WorkerPool([logged], exclusive_jobs=True)
    try:
        hold = pool.hold(0)
        first = [dataclasses.replace(r, keep_pages=True, session=r.prompt_id) for r in requests(3)]
        streamed = []
        turns = pool.submit(0, first, hold=hold, on_group=streamed.append).result()
        assert sorted(tokens(sum(streamed, []))) == sorted(tokens(turns))
        assert all(len(g) == 2 and len({r.prompt_id for r in g}) == 1 for g in streamed)
        newer = pool.submit(1, requests(2))  # queued behind the held epoch
        later = [
            Request(
                prompt_id=f"{ro.prompt_id}.{ro.sample_index}",
                prompt_tokens=tuple(int(t) for t in ro.prompt_tokens),
                continuation=(*ro.tokens.tolist(), 3),
                sampling=SamplingParams(seed=7, max_new_tokens=2),
                session=ro.prompt_id,
            )
            for ro in turns
        ]
        reused = worker.status().prefix_tokens_reused
        assert {r.version for r in pool.submit(0, later, hold=hold).result()} == {0}
        assert worker.status().prefix_tokens_reused > reused  # the kept pages, not recomputed
        assert not newer.done()  # it cannot run while the hold keeps version 0's epoch
        hold.release()
        assert {r.version for r in newer.result(timeout=60)} == {1}
        assert loads == [0, 1]
        with pytest.raises(RuntimeError, match="released hold"):
            pool.submit(0, later, hold=hold)
    finally:
        pool.close()
        worker.shutdown()


def test_closing_the_pool_ends_a_job_waiting_for_its_epoch(workers):
    """A job queued behind a kept epoch when the pool closes fails with PoolClosed (it is not
    handed to another worker as if its own had failed), or is cancelled if the close came before
    its coordination started; close(wait=True) returns."""
    pool = WorkerPool(workers[:1], exclusive_jobs=True, on_event=lambda text: None)
    hold = pool.hold(0)
    pool.submit(0, requests(1), hold=hold).result()
    waiting = pool.submit(0, requests(2))  # exclusive: behind the kept epoch until released
    closer = threading.Thread(target=pool.close, kwargs={"wait": True}, daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive()
    with pytest.raises((PoolClosed, cf.CancelledError)):
        waiting.result(timeout=10)
    hold.release()


def test_an_evaluation_joins_its_versions_epoch_ahead_of_a_newer_one(weights):
    """Throughput mode's epochs: version 0's epoch kept open (a hold), a job of version 1
    queued behind it; an evaluation of version 0 (``ahead``) runs in version 0's epoch instead
    of after version 1's, so the worker loads 0 and 1 once each (a plain job would wait for 1
    and load 0 again)."""
    model, source = weights
    worker = InferenceWorker(model, CFG, weight_source=source)
    logged = LoadsLogged(worker)
    loads = logged.loads

    pool = WorkerPool([logged])
    try:
        hold = pool.hold(0)
        pool.submit(0, requests(1), hold=hold).result()
        newer = pool.submit(1, requests(2))
        evaluated = pool.submit(0, requests(2), counted=False, ahead=True).result(timeout=60)
        assert {r.version for r in evaluated} == {0} and not newer.done()
        hold.release()
        assert {r.version for r in newer.result(timeout=60)} == {1}
        assert loads == [0, 1]
    finally:
        pool.close()
        worker.shutdown()


def test_the_pool_counts_the_weight_bytes_each_load_took_over_the_network(weights):
    """``wire_bytes`` (the metric weights/wire_bytes_per_load): workers served over gRPC pull each
    version from a real parameter server on 127.0.0.1; every load counts the version's bytes
    once per worker (the bytes cross the service's LoadWeights reply), a version already held
    counts nothing, and a worker whose source does not count (a dict here) adds nothing."""
    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.inference.service import InferenceClient, serve
    from rlax_tpu.param_server.client import ParamServerClient, PulledWeights
    from tests.param_server.conftest import running

    model, source = weights
    nbytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(source.versions[0]))
    with running(ParamServerConfig(persist_every=0)) as ps:
        for v in (0, 1):
            ps.client.push(source.versions[v], v)
        engines, readers = [], []
        for _ in range(2):  # each worker its own client, as components.py wires them
            readers.append(ParamServerClient(ps.endpoint, timeout_s=60))
            worker = InferenceWorker(model, CFG)
            worker.weight_source = PulledWeights(readers[-1], worker.engine.weight_shardings())
            engines.append(worker)
        engines.append(InferenceWorker(model, CFG, weight_source=source))  # counts nothing
        served = [serve(w, "127.0.0.1:0") for w in engines]
        clients = [InferenceClient(f"127.0.0.1:{port}") for _, port in served]
        pool = WorkerPool(clients)
        try:
            pool.submit(0, requests(6)).result()
            first = pool.take_times()
            pool.submit(0, requests(3)).result()  # held: no load
            second = pool.take_times()
            pool.submit(1, requests(3)).result()
            third = pool.take_times()
        finally:
            pool.close()
            for c in (*clients, *readers):
                c.close()
            for (server, _), w in zip(served, engines, strict=True):
                server.stop(None)
                w.shutdown()
    assert first["loads"] == third["loads"] == 3 and second["loads"] == 0
    assert first["wire_bytes"] == third["wire_bytes"] == 2 * nbytes
    assert second["wire_bytes"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["drained", "overlapped"])
def test_with_overlap_a_newer_version_loads_while_the_older_job_runs(weights, overlap):
    """Throughput mode with ``overlap``: version 1's job is loaded while version 0's job is
    queued in the engine and has not taken a step (the engine's steps are held back), and the
    engine swaps with version 0's samples running (no drain); each job's samples are its
    version's and the same as one worker's alone (the per-group seeds). Drained: the load waits
    for version 0's job to end."""
    model, source = weights
    worker = InferenceWorker(
        model, dataclasses.replace(CFG, overlap_reload=overlap), weight_source=source
    )
    gate, has_work, load = threading.Event(), worker.engine.has_work, worker.engine.load_weights
    # No step before gate.set(); the engine thread waits unlocked, so a load can swap meanwhile.
    worker.engine.has_work = lambda: gate.is_set() and has_work()
    running_at_load = []

    def open_gate():
        gate.set()
        with worker._cond:
            worker._cond.notify_all()

    def logged_load(version, params):
        running_at_load.append({s.weights for s in worker.engine.scheduler.all_sequences()})
        return load(version, params)

    worker.engine.load_weights = logged_load
    logged = LoadsLogged(worker)
    pool = WorkerPool([logged], overlap=overlap)
    try:
        first = pool.submit(0, requests(4))
        second = pool.submit(1, requests(3))
        deadline = time.monotonic() + (60 if overlap else 1)
        while logged.loads != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (logged.loads == [0, 1]) is overlap and not first.done()
        open_gate()
        got = [tokens(first.result(timeout=60)), tokens(second.result(timeout=60))]
    finally:
        open_gate()
        pool.close()
        worker.shutdown()
    # Version 1 swapped in with all of version 0's samples in the engine (overlap), or none.
    assert running_at_load[-1] == ({0} if overlap else set())
    assert {v for _, v in got[0].values()} == {0} and {v for _, v in got[1].values()} == {1}
    assert logged.loads == [0, 1] and worker.engine.older_version is None
    alone = InferenceWorker(model, CFG, weight_source=source)
    try:
        assert got[0] == tokens(alone.generate(requests(4), version=0))
        alone.load_weights(1)
        assert got[1] == tokens(alone.generate(requests(3), version=1))
    finally:
        alone.shutdown()
