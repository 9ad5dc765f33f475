"""The engine's data shards (``inference.mesh.data`` = D > 1) on the 8 forced CPU devices: each
shard owns 1/D of the KV pages and a block of the rows, a sequence's rows and pages stay in its
shard, the tokens are the single-device engine's, and no device gathers another shard's pages.

Tolerances: tokens exactly (greedy and seeded sampling). Log-probs: on data 2 alone to 1e-6
absolute + 1e-6 relative (each shard's program runs N/D rows, and XLA:CPU may round a matmul
of another row count differently in the last place: ~2 ulp of log-probs near -6); with
tensor 2 as well to 2e-5, the f32 round-off of a sum split over devices (test_engine_mesh.py).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import ConfigError, MeshConfig
from rlax_tpu.inference.engine import Engine, InvalidRequest
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.models.paged_cache import page_bytes
from rlax_tpu.models.programs import decode_program, idle_sampling

from .conftest import SMALL, by_key, mixed_requests, random_requests

CFG = dataclasses.replace(SMALL, max_concurrent_seqs=8)
DATA2 = MeshConfig(data=2, fsdp=1, tensor=1)
DATA2_TENSOR2 = MeshConfig(data=2, fsdp=1, tensor=2)
# One max-length sequence (12 pages) + the null page + 3 spares per shard: preemptions.
PAGES_PER_SHARD = 16


def _requests() -> list[Request]:
    return mixed_requests(sampled=8, greedy=6)


def _kv_pages(engine: Engine) -> list[jax.Array]:
    return [
        x
        for x in (engine.cache.k_pages, engine.cache.v_pages, engine.cache.kv_pages)
        if x is not None
    ]


def _per_device_bytes(engine: Engine) -> int:
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in _kv_pages(engine)
    )


class ShardWatch:
    """Checks, on every step of a data-sharded engine, that each sequence's program rows lie in
    its shard's block and its pages in its shard's allocator; counts what it saw."""

    def __init__(self, engine: Engine):
        self.engine, self.forks, self.shards_used = engine, 0, set()
        self._row_index, self._fork = engine._row_index, engine.scheduler.fork
        engine._row_index = self.row_index
        engine.scheduler.fork = self.fork

    def row_index(self, rows: list, n: int, *, at_end: bool) -> list[int]:
        index = self._row_index(rows, n, at_end=at_end)
        per = n // self.engine.data_shards
        assert sorted(index) == sorted(set(index)) and all(0 <= i < n for i in index)
        for i, row in zip(index, rows, strict=True):
            assert i // per == row.seq.shard, (i, row.seq.shard)
            self.shards_used.add(row.seq.shard)
        return index

    def fork(self, parent):  # noqa: ANN001, ANN201 - Scheduler.fork's
        children = self._fork(parent)
        assert {c.shard for c in children} == {parent.shard}
        self.forks += len(children) > 1
        return children

    def run(self) -> list:
        out = []
        while self.engine.has_work():
            out += self.engine.step()
            # Per shard: the allocator's reference counts are exactly its sequences' pages
            # (a page of another shard's allocator in a table would break its counts).
            self.engine.scheduler.check_invariants()
            for seq in self.engine.scheduler.running:
                local = self.engine.allocators[seq.shard]
                assert all(0 < p < local.num_pages for p in seq.table.pages)
        assert all(a.num_used == 0 for a in self.engine.allocators)
        return out


@pytest.fixture(scope="module")
def single(tiny_model):
    engine = Engine(
        tiny_model,
        dataclasses.replace(
            CFG, kv_cache_bytes=PAGES_PER_SHARD * page_bytes(tiny_model.cfg, CFG.page_size)
        ),
    )
    for r in _requests():
        engine.submit(r)
    return by_key(engine.run())


@pytest.mark.parametrize("mesh", [DATA2, DATA2_TENSOR2], ids=["data2", "data2xtensor2"])
def test_data_shards_give_the_single_device_tokens(tiny_model, single, mesh):
    """Greedy and seeded temperature-1 samples, a group of 4 sharing its prompt's pages and a
    page budget that preempts: the tokens are the single-device engine's, and every row and
    page of a sequence is in its shard (both shards used)."""
    budget = mesh.data * PAGES_PER_SHARD * page_bytes(tiny_model.cfg, CFG.page_size)
    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=mesh, kv_cache_bytes=budget))
    assert engine.data_shards == 2 and [a.num_pages for a in engine.allocators] == [16, 16]
    watch = ShardWatch(engine)
    for r in _requests():
        engine.submit(r)
    got = by_key(watch.run())
    assert watch.shards_used == {0, 1} and watch.forks > 0
    assert engine.scheduler.num_preemptions > 0 and engine.stats().pages_shared > 0
    assert engine.stats().pages_total == 2 * 15
    assert got.keys() == single.keys()
    tol = dict(rtol=1e-6, atol=1e-6) if mesh.tensor == 1 else dict(rtol=0, atol=2e-5)
    for key, want in single.items():
        np.testing.assert_array_equal(got[key].tokens, want.tokens, err_msg=str(key))
        np.testing.assert_allclose(got[key].logprobs, want.logprobs, **tol, err_msg=str(key))


@pytest.mark.parametrize(
    ("mesh", "options"),
    [(DATA2_TENSOR2, dict(backend="tpu_emulated")), (DATA2, dict(span_groups=2))],
    ids=["tpu_layout-data2xtensor2", "span_groups-data2"],
)
def test_data_shards_serve_the_tpu_layout_and_span_groups(tiny_model, mesh, options):
    """The TPU path's combined pages (split by page over data; the ragged kernel's stand-in in
    its own shard_map over tensor inside the data shard's) and span groups (each shard's block
    of rows grouped alike) give the single-device engine's tokens; log-probs as above."""
    runs = []
    for m in (None, mesh):
        pages = PAGES_PER_SHARD * (1 if m is None else m.data)
        budget = pages * page_bytes(tiny_model.cfg, CFG.page_size, options.get("backend", "cpu"))
        cfg = dataclasses.replace(CFG, kv_cache_bytes=budget, **options)
        engine = Engine(tiny_model, cfg if m is None else dataclasses.replace(cfg, mesh=m))
        watch = ShardWatch(engine)
        for r in _requests():
            engine.submit(r)
        runs.append((by_key(watch.run()), engine))
    (want, _), (got, sharded) = runs
    assert sharded.scheduler.num_preemptions > 0
    if sharded.cache.kv_pages is not None:
        assert sharded.cache.kv_pages.sharding.spec == P(None, "data", None, "tensor")
    assert got.keys() == want.keys()
    tol = dict(rtol=1e-6, atol=1e-6) if mesh.tensor == 1 else dict(rtol=0, atol=2e-5)
    for key, ro in want.items():
        np.testing.assert_array_equal(got[key].tokens, ro.tokens, err_msg=str(key))
        np.testing.assert_allclose(got[key].logprobs, ro.logprobs, **tol, err_msg=str(key))


def test_each_device_holds_half_the_pages_on_two_data_shards(tiny_model):
    """Per-device KV bytes (from the arrays' shard shapes) halve from data 1 to data 2, with the
    KV heads whole (tensor 1) or split (tensor 2)."""
    per_device = {}
    for data, tensor in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        mesh = MeshConfig(data=data, fsdp=1, tensor=tensor)
        engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=mesh))
        total = sum(x.nbytes for x in _kv_pages(engine))
        per_device[data, tensor] = _per_device_bytes(engine)
        assert per_device[data, tensor] * data * tensor == total
    assert per_device[2, 1] * 2 == per_device[1, 1]
    assert per_device[2, 2] * 2 == per_device[1, 2]


def _collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result dims) of every all-gather / all-to-all / collective-permute / all-reduce in
    compiled HLO text (a tuple result: each element)."""
    out = []
    for line in hlo.splitlines():
        match = re.search(
            r"=\s*(.*?)\s(all-gather|all-to-all|collective-permute|all-reduce)(?:-start)?\(",
            line,
        )
        if match:
            for dims in re.findall(r"\[([\d,]*)\]", match.group(1)):
                out.append((match.group(2), tuple(int(d) for d in dims.split(",") if d)))
    return out


def _decode_hlo(engine: Engine, cache) -> str:  # noqa: ANN001
    n, m = engine.step_tokens, engine.pages_per_seq
    args = (
        engine.state,
        cache,
        np.zeros(n, np.int32),
        np.full(n, -1, np.int32),
        np.zeros((n, m), np.int32),
        idle_sampling(n),
    )
    with jax.set_mesh(engine.mesh):
        return decode_program.lower(*args, graphdef=engine.graphdef).compile().as_text()


def test_the_decode_program_moves_no_pages_between_data_shards(tiny_model):
    """The compiled decode program on data 2 has no collective on a pages-shaped operand (a
    dimension of the pool's page count or a shard's): each shard gathers its own pages. The
    check itself is shown to catch one: the same pages split over data, attended with one
    pool's global page ids, make XLA all-gather them."""
    pages = 2 * 37  # a page count no other array's dimension has
    budget = pages * page_bytes(tiny_model.cfg, CFG.page_size)
    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=DATA2, kv_cache_bytes=budget))
    assert engine.cache.k_pages.shape[2] == pages
    sharded = _collectives(_decode_hlo(engine, engine.cache))
    assert not [c for c in sharded if {pages, pages // 2} & set(c[1])], sharded

    one_pool = dataclasses.replace(engine.cache, shards=1)
    split = NamedSharding(engine.mesh, P(None, None, "data"))
    one_pool = dataclasses.replace(
        one_pool,
        k_pages=jax.device_put(one_pool.k_pages, split),
        v_pages=jax.device_put(one_pool.v_pages, split),
    )
    gathered = _collectives(_decode_hlo(engine, one_pool))
    assert [c for c in gathered if c[0] == "all-gather" and pages in c[1]], gathered


def test_shard_sizes_must_divide_by_data(tiny_model):
    with pytest.raises(ConfigError, match="step_tokens = 5: must divide by mesh.data = 2"):
        dataclasses.replace(CFG, mesh=DATA2, max_concurrent_seqs=5)
    with pytest.raises(ConfigError, match="prefill_rows = 3: must divide by mesh.data = 2"):
        dataclasses.replace(CFG, mesh=DATA2, prefill_rows=3)
    # A mesh of data -1 is sized by the worker's devices: the engine checks then.
    with pytest.raises(ValueError, match="step_tokens \\(6\\) and prefill_rows \\(4\\)"):
        Engine(
            tiny_model,
            dataclasses.replace(
                CFG, mesh=MeshConfig(data=-1, fsdp=1, tensor=2), max_concurrent_seqs=6
            ),
            devices=jax.devices()[:8],
        )
    too_few = 20 * page_bytes(tiny_model.cfg, CFG.page_size)  # 10 per shard, 13 needed
    with pytest.raises(ValueError, match="holds 20 pages \\(10 per data shard of 2\\)"):
        Engine(tiny_model, dataclasses.replace(CFG, mesh=DATA2, kv_cache_bytes=too_few))
    odd = 27 * page_bytes(tiny_model.cfg, CFG.page_size)  # rounded down to 26: 13 per shard
    engine = Engine(tiny_model, dataclasses.replace(CFG, mesh=DATA2, kv_cache_bytes=odd))
    assert [a.num_pages for a in engine.allocators] == [13, 13]
    # A group's samples share its prompt's pages, so they fit one shard's 4 rows.
    with pytest.raises(InvalidRequest, match="exceeds the 4 decode rows of one data shard"):
        engine.submit(random_requests(1, num_samples=5)[0])


def test_a_continuation_runs_on_the_shard_that_kept_its_pages(tiny_model):
    """First turns on two data shards keep their pages; each next turn is admitted on the shard
    holding them and takes them (its rows and pages stay there: ShardWatch), with the single
    device engine's tokens."""
    firsts = [
        dataclasses.replace(r, keep_pages=True)
        for r in random_requests(6, seed=3, num_samples=2, temperature=1.0, max_new=8)
    ]
    runs = []
    for mesh in (None, DATA2):
        cfg = CFG if mesh is None else dataclasses.replace(CFG, mesh=mesh)
        engine = Engine(tiny_model, cfg)
        for r in firsts:
            engine.submit(r)
        first = by_key(engine.run())
        kept = {e.tokens: e.shard for e in engine.scheduler.kept._entries.values()}
        assert len(kept) == 12 and set(kept.values()) == ({0, 1} if mesh else {0})
        nexts = [
            Request(
                prompt_id=f"{key}.{i}",
                prompt_tokens=tuple(ro.prompt_tokens.tolist()),
                continuation=(*ro.tokens.tolist(), 9, 10),
                sampling=dataclasses.replace(_sampling_of(firsts, key), max_new_tokens=5),
            )
            for (key, i), ro in first.items()
        ]
        admitted = {}
        place = engine.scheduler._admit

        def admit(scheduler=engine.scheduler, place=place, admitted=admitted):
            waiting = list(scheduler.waiting)
            place()
            for seq in waiting:
                if seq not in scheduler.waiting:
                    admitted[seq.request.prompt_id] = (seq.shard, seq.num_computed)

        engine.scheduler._admit = admit
        for r in nexts:
            engine.submit(r)
        watch = ShardWatch(engine) if mesh else None
        got = by_key(watch.run() if watch else engine.run())
        runs.append(got)
        assert engine.stats().prefix_tokens_reused > 0
        for (key, i), ro in first.items():
            held = (*ro.prompt_tokens.tolist(), *ro.tokens[:-1].tolist())
            shard, computed = admitted[f"{key}.{i}"]
            assert computed == len(held) and shard == kept[held]
    single, sharded = runs
    assert sharded.keys() == single.keys()
    for key, want in single.items():
        np.testing.assert_array_equal(sharded[key].tokens, want.tokens, err_msg=str(key))


def _sampling_of(requests: list[Request], key: str):
    return next(r.sampling for r in requests if r.prompt_id == key)
