"""The inference engine: paged KV cache + continuous batching + sampling + weight versions.

Numerical contract (what a replay does to reproduce the reported log-probs bitwise):

* A sequence's prompt prefix (positions 0..P-2 of a P-token prompt) is written by the prefill
  program (``models.programs.prefill_program``): the model on tokens/positions [R, C]
  (R = ``inference.prefill_rows``, C = ``inference.prefill_len``), one chunk [kC, (k+1)C) per
  row, unused rows/tails padded with position -1; keys and values only, no logits.
  ``prefill_rows = 0``: no prefill program.
* Every other token (from position P-1 on, or all of them without the prefill program) runs
  through the decode program (``models.programs.decode_program``) on tokens/positions [N],
  N = ``step_tokens`` (``inference.step_tokens``, 0 -> ``max_concurrent_seqs``): one token per
  row, unused rows padded with position -1; attention over the sequence's pages, S =
  ``pages_per_seq * page_size`` positions (:attr:`Engine.cache_len`), on CPU by the native
  kernel or block by block up to the step's furthest position (``inference.attention_kernel``,
  ``attention_block_pages``; either gives a row the same bits whatever the other rows hold);
  then the sampler
  (``models.sampling``) draws the token and reports ``log_softmax(z / T)[token]`` in f32
  (``logprob_policy = "temperature_scaled"``, T = the request's temperature, T = 1 when greedy)
  or the top-k/top-p renormalized one (``"sampler"``), from the f32 logits z.
* ``models.replay_logprobs`` runs those same jitted functions at the engine's shapes
  (:attr:`Engine.replay_shape`) with the tokens forced, so on the same host it runs the same
  compiled programs and reproduces the temperature-scaled log-probs bit for bit; a token's bits
  do not depend on its row, on paging, on preemption/recompute or on which other sequences share
  the step. That rests on this host's XLA:CPU rounding every row alike, which the engine checks
  at start-up (``models.programs.rows_are_independent``); where it does not, one warning says
  so, :attr:`EngineStats.rows_bitwise` is False and all of the above holds to ~1e-6 only. Another program computing the same math (a dense cache, a full-sequence
  ``forward``, the log-softmax in a program of its own: :func:`replay.replay_logits`) agrees only
  to f32 round-off (~1e-6), and how far depends on the host.
* With ``inference.span_groups`` >= 2 (CPU backend) a step's rows, sorted by position, attend in
  groups over fewer cache entries than S, each grouping its own program; the rounding then
  depends on the group, so a replay agrees only to that round-off (and the log-probs of a
  request alone and in a crowd agree to ~1e-6; its tokens come from the same per-request
  streams).

Data shards: on a mesh with ``inference.mesh.data`` = D > 1 the page pool and the rows of both
programs are cut into D contiguous blocks over the data axis (``PagedKVCache.shards``); a
sequence lives on one shard, its rows in that shard's block and its pages in that shard's pages
(the scheduler places it at admission; its samples stay with its shared prompt pages), so a
device holds 1/D of the pages (1/(D * tensor) with the KV heads split) and attends without
another shard's pages. ``step_tokens``, ``prefill_rows`` and the pages must divide by D (the
pages the budget holds are rounded down to a multiple of it), and a request's samples fit one
shard's ``step_tokens / D`` rows. data = 1 is the single pool above, unchanged.

Kept pages (``Request.keep_pages``, ``inference/prefix_cache.py``): a finished sample's pages may
outlive it for the request that continues its sequence (an episode's next turn), which then
computes only the positions after them, with the programs and positions it would have used
anyway: the same bits as recomputing.

Versions: the engine serves the weights of ``version``; every token records the version that
produced it. :meth:`Engine.load_weights` runs between steps. With ``continue_on_reload`` the
in-flight samples continue with the new weights (their cached keys/values from the old weights
are kept) and record per-token versions. Else with ``overlap_reload`` they finish on the weights
they started on: the engine keeps the replaced weights (one older version, a second copy) until
its last sequence ends, and a step runs each version's rows through the same programs with its
own weights (a row's bits do not depend on the others, so a sample is what a drained reload
would have given); a load while an older version still runs aborts that older one's. Otherwise
in-flight samples are aborted and returned (``FinishReason.ABORTED``, with the tokens they
have). Kept pages belong to the served version: a load drops them, and a sequence of an older
version neither keeps pages nor takes any.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlax_tpu import models
from rlax_tpu.config import InferenceConfig
from rlax_tpu.config.mesh import AXES as MESH_AXES
from rlax_tpu.inference.pages import PageAllocator
from rlax_tpu.inference.sampler import InvalidSampling, SamplingParams
from rlax_tpu.inference.scheduler import (
    Chunk,
    Plan,
    Request,
    Row,
    Scheduler,
    Sequence,
    block_table_rows,
)
from rlax_tpu.models.adapters import split_adapters
from rlax_tpu.models.paged_cache import PagedKVCache, cache_shardings, page_bytes
from rlax_tpu.models.programs import (
    TRACES,
    copy_pages,
    decode_program,
    host_copy,
    idle_sampling,
    prefill_program,
    rows_are_independent,
)
from rlax_tpu.types import FinishReason, Rollout

# Tokens beyond a stop string's characters that _stopped decodes (tokens that decode to nothing:
# partial UTF-8 bytes, empty specials).
_STOP_SLACK_TOKENS = 8


@functools.cache  # once per process: every engine on this host would say the same
def _warn_rows_not_bitwise() -> None:
    logging.getLogger(__name__).warning(
        "this host's XLA:CPU does not give every batch row the same rounding (start-up "
        "check of the engine's compiled programs): log-probs match the trainer's replay and "
        "a request's samples match across batches only to f32 round-off (~1e-6), not bit for "
        "bit; the run continues in that tolerance mode (EngineStats.rows_bitwise = False)"
    )


def _warn_if_pages_replicated(cache: PagedKVCache, mesh: Mesh | None, kv_heads: int) -> None:
    """Says at start-up what a tensor degree that does not divide the KV heads costs: every
    device then holds every head's pages of its data shard (cache_shardings replicates them over
    tensor) instead of 1/tensor."""
    tensor = mesh.shape["tensor"] if mesh is not None else 1
    if tensor == 1:
        return
    pages = [x for x in (cache.k_pages, cache.v_pages, cache.kv_pages) if x is not None]
    whole = sum(x.nbytes for x in pages) / cache.shards  # one data shard's pages
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in pages)
    if per_device * tensor > whole:
        logging.getLogger(__name__).warning(
            "inference.mesh.tensor = %d does not divide the model's %d KV heads: every device "
            "holds the whole KV cache%s (%.1f MiB) instead of 1/%d of it (%.1f MiB); a tensor "
            "degree that divides the KV heads splits it",
            tensor,
            kv_heads,
            "" if cache.shards == 1 else f" of its data shard (1/{cache.shards} of the pages)",
            per_device / 2**20,
            tensor,
            whole / tensor / 2**20,
        )


def engine_mesh(cfg: InferenceConfig, devices: list[jax.Device] | None = None) -> Mesh | None:
    """The mesh ``inference.mesh`` lays out over the first of ``devices`` (default: all of this
    process's view), or None for one device (the programs then carry no shardings at all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.mesh.sizes
    if -1 not in sizes:
        need = math.prod(sizes)
        if need > len(devices):
            axes = " x ".join(f"{a} {n}" for a, n in zip(MESH_AXES, sizes, strict=True))
            raise ValueError(
                f"inference.mesh needs {need} devices ({axes}); this worker has {len(devices)}"
            )
        devices = devices[:need]
    if len(devices) == 1:
        return None
    return models.make_mesh(cfg.mesh, devices)


class InvalidRequest(ValueError):
    """A request the engine cannot serve (empty or too long prompt, bad sampling parameters)."""


class InvalidWeights(ValueError):
    """Weights whose structure, shapes or dtypes differ from the served model's."""


def _leaf_paths(tree: Any) -> set[tuple[str, ...]]:
    """A nested tree's leaf paths, keys as strings (a pulled tree's layer "0" or list item 0 is
    the model's layer 0)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in paths}


@dataclasses.dataclass(frozen=True)
class EngineStats:
    version: int
    running: int
    waiting: int
    pages_total: int
    pages_free: int
    compilations: int
    steps: int
    generated_tokens: int
    preemptions: int
    pages_shared: int  # page references saved by prefix sharing so far (pages not copied)
    # Positions continuations took from kept pages instead of recomputing (Request.keep_pages).
    prefix_tokens_reused: int
    # False: this host's XLA:CPU rounds a row by its index or neighbours (the start-up check of
    # models.programs.rows_are_independent failed), so log-probs match a replay only to ~1e-6.
    rows_bitwise: bool


class Engine:
    """Single-threaded engine; the worker serializes calls. See the module docstring."""

    def __init__(
        self,
        model: models.Transformer,
        cfg: InferenceConfig,
        *,
        version: int = 0,
        eos_ids: Collection[int] = (),
        devices: list[jax.Device] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        """``devices``: where ``inference.mesh`` is laid out (default: ``jax.devices()``).
        ``detokenize``: token ids -> text (special tokens as text), for requests' stop strings
        (None: such requests are refused)."""
        self.cfg, self.model_cfg = cfg, model.cfg
        self.version = version
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.detokenize = detokenize
        self.mesh = engine_mesh(cfg, devices)
        if self.mesh is None and devices and devices[0] != jax.devices()[0]:
            # One device that is not the default (a host's devices split between components):
            # a mesh of one places the engine there.
            self.mesh = models.make_mesh(cfg.mesh, list(devices[:1]))
        if cfg.attention_kernel == "native" and self.mesh is not None and self.mesh.size > 1:
            # The native kernel is one device's custom call: on a mesh the programs skip it.
            raise ValueError(
                f"inference.attention_kernel = 'native' runs on one device; this engine's "
                f"inference.mesh spans {self.mesh.size} ({dict(self.mesh.shape)}): use 'auto' "
                "(native where it can run, XLA here) or 'xla'"
            )
        # Data shards (module docstring): the mesh's data degree.
        self.data_shards = self.mesh.shape["data"] if self.mesh is not None else 1
        # The shapes every program is compiled for: a replay at them reproduces the log-probs.
        self.replay_shape = models.ReplayShape.of_engine(
            cfg, model.cfg, data_shards=self.data_shards
        )
        self.graphdef, state = nnx.split(model)
        self.state = self._place(state)
        # (version, weights) replaced by an overlapped reload, kept for the sequences on them.
        self._older: tuple[int, Any] | None = None
        d = self.data_shards
        num_pages = self.replay_shape.num_pages
        if num_pages // d < 1 + self.pages_per_seq:
            per_shard = "" if d == 1 else f" ({num_pages // d} per data shard of {d})"
            raise ValueError(
                f"inference.kv_cache_bytes = {cfg.kv_cache_bytes} holds {num_pages} pages"
                f"{per_shard} of "
                f"{page_bytes(model.cfg, cfg.page_size, self.replay_shape.backend)} bytes; one "
                f"sequence of max_prompt_len + max_new_tokens tokens needs {self.pages_per_seq} "
                "plus the null page"
            )
        # One pool per data shard, page ids local to it (0: the shard's null page).
        self.allocators = [PageAllocator(num_pages // d) for _ in range(d)]
        self.scheduler = Scheduler(
            self.allocators,
            page_size=cfg.page_size,
            max_seqs=cfg.max_concurrent_seqs,
            step_tokens=self.step_tokens,
            prefill_chunk=cfg.prefill_chunk,
            prefill_rows=cfg.prefill_rows,
            prefill_len=cfg.prefill_len,
        )
        self.scheduler.weights = version
        self.cache = self._place(self.replay_shape.make_cache(model.cfg))
        _warn_if_pages_replicated(self.cache, self.mesh, model.cfg.num_kv_heads)
        self._traces_at_start = TRACES.total()
        with self._on_mesh():
            self.rows_bitwise, self.cache = rows_are_independent(
                self.state,
                self.cache,
                graphdef=self.graphdef,
                prefill_rows=cfg.prefill_rows,
                prefill_len=cfg.prefill_len,
            )
        if not self.rows_bitwise:
            _warn_rows_not_bitwise()
        self.steps = 0
        self.prefill_calls = 0
        self.generated_tokens = 0
        self.pages_shared = 0

    def _on_mesh(self) -> contextlib.AbstractContextManager:
        """The engine's mesh as the context of its programs (activation and cache constraints
        read it); nothing on one device."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _place(self, tree: Any) -> Any:
        """Parameters (an nnx.State) or the paged cache onto the mesh by the logical rules."""
        if self.mesh is None:
            return tree
        if isinstance(tree, PagedKVCache):
            return jax.device_put(tree, cache_shardings(tree, self.mesh))
        return jax.device_put(tree, models.param_shardings(tree, self.mesh))

    def weight_shardings(self) -> Any:
        """Where each parameter lives, as the pure-dict tree the trainer publishes (with LoRA
        adapters, the adapters alone): a weight source builds each array from the slices this
        process's devices hold."""
        tree = nnx.to_pure_dict(jax.tree.map(lambda a: a.sharding, self.state))
        adapters, _ = split_adapters(tree)
        return adapters or tree

    @property
    def step_tokens(self) -> int:
        """Rows of every decode step."""
        return self.replay_shape.slots

    @property
    def pages_per_seq(self) -> int:
        return self.replay_shape.pages_per_seq

    @property
    def cache_len(self) -> int:
        """KV positions per sequence."""
        return self.replay_shape.cache_len

    @property
    def backend(self) -> str:
        return self.replay_shape.backend

    @property
    def compilations(self) -> int:
        """Programs traced (so compiled) in this process since the engine was built: the step for
        a new shape or sampling variant, a page-copy bucket. 0 per step in steady state."""
        return TRACES.total() - self._traces_at_start

    # -- requests -----------------------------------------------------------------------------

    def check_request(self, request: Request) -> Request:
        """The request with its sampling defaults resolved; raises InvalidRequest with a message
        naming what is wrong."""
        n, vocab = len(request.prompt_tokens), self.model_cfg.vocab_size
        where = f"request {request.prompt_id!r}"
        if n == 0:
            raise InvalidRequest(f"{where}: empty prompt")
        if n > self.cfg.max_prompt_len:
            raise InvalidRequest(
                f"{where}: prompt of {n} tokens is longer than inference.max_prompt_len = "
                f"{self.cfg.max_prompt_len}"
            )
        bad = [t for t in (*request.prompt_tokens, *request.continuation) if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
            )
        if not 1 <= request.num_samples <= self.cfg.max_concurrent_seqs:
            raise InvalidRequest(
                f"{where}: num_samples = {request.num_samples} must be in [1, "
                f"inference.max_concurrent_seqs = {self.cfg.max_concurrent_seqs}]"
            )
        rows = self.step_tokens // self.data_shards
        if request.num_samples > rows:  # a group lives on one data shard, one row per sample
            raise InvalidRequest(
                f"{where}: num_samples = {request.num_samples} exceeds the {rows} decode rows "
                f"of one data shard (step_tokens {self.step_tokens} / inference.mesh.data "
                f"{self.data_shards})"
            )
        sampling = request.sampling.resolved(self.cfg)
        try:
            sampling.check(vocab_size=vocab, max_new_tokens=self.cfg.max_new_tokens)
        except InvalidSampling as e:
            raise InvalidRequest(f"{where}: {e}") from e
        if sampling.stop and self.detokenize is None:
            raise InvalidRequest(
                f"{where}: stop strings {list(sampling.stop)} need the worker's tokenizer, and "
                "this engine has none (stop_sequences of token ids need none)"
            )
        longest = n + len(request.continuation) + sampling.max_new_tokens
        if longest > self.cache_len:
            raise InvalidRequest(
                f"{where}: prompt {n} + continuation {len(request.continuation)} + max_new_tokens "
                f"{sampling.max_new_tokens} = {longest} tokens do not fit a sequence's "
                f"{self.cache_len} cache positions"
            )
        return dataclasses.replace(request, sampling=sampling)

    def submit(self, request: Request, version: int | None = None) -> None:
        """Queues ``request`` on the weights of ``version`` (default: the served ones; else one
        the engine holds, :meth:`holds`)."""
        if version is not None and not self.holds(version):
            raise ValueError(f"version {version} is not held (serving {self.version})")
        self.scheduler.add(self.check_request(request), version)

    def holds(self, version: int) -> bool:
        """Serves ``version``, or still runs sequences on it (an overlapped reload)."""
        return version == self.version or self.older_version == version

    @property
    def older_version(self) -> int | None:
        """The version an overlapped reload replaced, while sequences still run on it."""
        return None if self._older is None else self._older[0]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping -----------------------------------------------------------------------------

    def _sampling_arrays(self, rows: list, index: list[int]) -> dict[str, np.ndarray]:
        arrays = idle_sampling(self.step_tokens)
        for r, row in zip(index, rows, strict=True):
            if not row.sample:
                continue
            s: SamplingParams = row.seq.request.sampling
            arrays["temperature"][r] = s.temperature
            arrays["top_k"][r] = s.top_k
            arrays["top_p"][r] = s.top_p
            arrays["seeds"][r] = s.seed & 0xFFFFFFFF
            arrays["sample_index"][r] = row.seq.sample_index
            arrays["token_index"][r] = len(row.seq.generated)
        return arrays

    def step(self) -> list[Rollout]:
        """Runs one engine step; returns the samples that finished in it."""
        plan = self.scheduler.plan()
        if not plan.rows and not plan.chunks:
            return []
        # Padding rows first, then rows by position: row groups then attend over their own
        # longest row's pages (spans), not the whole cache's.
        plan = dataclasses.replace(plan, rows=sorted(plan.rows, key=lambda row: row.position))
        with self._on_mesh():
            results = self._run_programs(plan)
        self.steps += 1
        finished = self._apply_results(plan, results)
        self._drop_unused_older()
        return finished

    def _row_index(self, rows: list[Row] | list[Chunk], n: int, *, at_end: bool) -> list[int]:
        """The program row of each of ``rows`` (in order) among ``n``: data shard s's rows in
        their order in its block [s n/D, (s + 1) n/D), at its end (padding rows first) or
        its start."""
        per = n // self.data_shards
        left = [0] * self.data_shards
        if at_end:
            left = [per] * self.data_shards
            for row in rows:
                left[row.seq.shard] -= 1
        taken = [0] * self.data_shards
        index = []
        for row in rows:
            s = row.seq.shard
            index.append(s * per + left[s] + taken[s])
            taken[s] += 1
        return index

    def _run_programs(self, plan: Plan) -> list[tuple[dict[str, np.ndarray], int]]:
        """The step's page copies, then each weight version's prefill and decode programs with
        its weights; for each of ``plan.rows``, its decode outputs and its row in them."""
        self.cache = copy_pages(self.cache, plan.copies)
        results: list[Any] = [None] * len(plan.rows)
        versions = {ch.seq.weights for ch in plan.chunks} | {r.seq.weights for r in plan.rows}
        for version in sorted(versions):
            state = self.state if version == self.version else self._older_state(version)
            chunks = [ch for ch in plan.chunks if ch.seq.weights == version]
            if chunks:
                self._prefill(chunks, state)
            mine = [k for k, row in enumerate(plan.rows) if row.seq.weights == version]
            if mine:
                out, index = self._decode([plan.rows[k] for k in mine], state)
                for k, r in zip(mine, index, strict=True):
                    results[k] = (out, r)
        return results

    def _older_state(self, version: int) -> Any:
        assert self._older is not None and self._older[0] == version, (version, self._older)
        return self._older[1]

    def _decode(self, rows: list[Row], state: Any) -> tuple[dict[str, np.ndarray], list[int]]:
        """The decode program on ``rows`` (sorted by position) with ``state``; (its outputs,
        each row's index in them)."""
        n = self.step_tokens
        index = self._row_index(rows, n, at_end=True)
        tokens = np.zeros(n, np.int32)
        positions = np.full(n, -1, np.int32)
        for r, row in zip(index, rows, strict=True):
            tokens[r], positions[r] = row.token, row.position
        tables = np.zeros((n, self.pages_per_seq), np.int32)
        tables[index] = block_table_rows(rows, self.pages_per_seq, len(rows))
        # Host arrays straight to the program: jit's dispatch transfers them (faster than
        # a jnp.asarray each).
        out, self.cache = decode_program(
            state,
            self.cache,
            tokens,
            positions,
            tables,
            self._sampling_arrays(rows, index),
            graphdef=self.graphdef,
            spans=self._spans(positions // self.cfg.page_size + 1),
        )
        return jax.device_get(out), index

    def _spans(self, pages: np.ndarray) -> tuple[tuple[int, int], ...]:
        """pages [N], ascending within each data shard's block (a row's pages to attend over;
        padding rows first, 0) -> the (rows, pages) of each span group of a block (the largest
        over the blocks), or () when span groups are off."""
        groups = self.cfg.span_groups
        if groups < 2 or self.backend != "cpu":
            return ()
        blocks = pages.reshape(self.data_shards, -1)
        bucket = self.cfg.span_bucket_pages
        bounds = np.linspace(0, blocks.shape[1], groups + 1)
        spans = []
        for start, stop in zip(bounds[:-1].astype(int), bounds[1:].astype(int), strict=True):
            need = max(1, int(blocks[:, start:stop].max(initial=0)))
            spans.append((int(stop - start), min(self.pages_per_seq, -(-need // bucket) * bucket)))
        return tuple(spans)

    def span_choices(self) -> list[tuple[tuple[int, int], ...]]:
        """Every span grouping a decode step can use (one compiled program each); [()] when
        span groups are off."""
        probe = self._spans(np.zeros(self.step_tokens, np.int64))
        if not probe:
            return [()]
        rows = [r for r, _ in probe]
        bucket, m = self.cfg.span_bucket_pages, self.pages_per_seq
        sizes = sorted({min(m, k * bucket) for k in range(1, -(-m // bucket) + 1)})
        return [
            tuple(zip(rows, combo, strict=True))
            for combo in itertools.combinations_with_replacement(sizes, len(rows))
        ]

    def precompile(self) -> int:
        """Compiles the decode program for every span grouping (and the prefill program) by
        running all-padding steps, which write nothing; returns the programs compiled. Run it
        once before timed or latency-sensitive work when span groups are on."""
        with self._on_mesh():
            return self._precompile()

    def _precompile(self) -> int:
        before = TRACES.total()
        n, m = self.step_tokens, self.pages_per_seq
        idle = (
            np.zeros(n, np.int32),
            np.full(n, -1, np.int32),
            np.zeros((n, m), np.int32),
            self._sampling_arrays([], []),
        )  # positional host arrays, as step() passes them: jit keys its cache on the call
        for spans in self.span_choices():
            _, self.cache = decode_program(
                self.state, self.cache, *idle, graphdef=self.graphdef, spans=spans
            )
        if self.cfg.prefill_rows:
            r, c = self.cfg.prefill_rows, self.cfg.prefill_len
            self.cache, _ = prefill_program(
                self.state,
                self.cache,
                jnp.zeros((r, c), jnp.int32),
                jnp.full((r, c), -1, jnp.int32),
                jnp.zeros((r, m), jnp.int32),
                graphdef=self.graphdef,
            )
        return TRACES.total() - before

    def _prefill(self, chunks: list[Chunk], state: Any) -> None:
        r, c = self.cfg.prefill_rows, self.cfg.prefill_len
        tokens = np.zeros((r, c), np.int32)
        positions = np.full((r, c), -1, np.int32)
        index = self._row_index(chunks, r, at_end=False)
        for i, ch in zip(index, chunks, strict=True):
            tokens[i, : ch.stop - ch.start] = ch.seq.tokens[ch.start : ch.stop]
            positions[i, : ch.stop - ch.start] = np.arange(ch.start, ch.stop)
        tables = np.zeros((r, self.pages_per_seq), np.int32)
        tables[index] = block_table_rows(chunks, self.pages_per_seq, len(chunks))
        self.cache, experts = prefill_program(
            state,
            self.cache,
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(tables),
            graphdef=self.graphdef,
        )
        self.prefill_calls += 1
        if experts is not None:
            experts = host_copy(experts)  # [L, R, C, k]
            for i, ch in zip(index, chunks, strict=True):
                span = np.arange(ch.start, ch.stop)
                self._record(ch.seq, span, experts[:, i, : len(span)].swapaxes(0, 1))

    def _record(self, seq: Sequence, positions: np.ndarray, experts: np.ndarray) -> None:
        """A MoE model's experts [n, L, k] of ``seq``'s ``positions`` [n] (routing replay)."""
        if seq.routes is None:
            cfg = self.model_cfg
            seq.routes = np.full(
                (self.cache_len, cfg.num_layers, cfg.experts_per_token), -1, np.int16
            )
        seq.routes[positions] = experts

    def _apply_results(
        self, plan: Plan, results: list[tuple[dict[str, np.ndarray], int]]
    ) -> list[Rollout]:
        finished: list[Rollout] = []
        for (out, r), row in zip(results, plan.rows, strict=True):
            if "experts" in out:  # before a fork copies a parent's
                self._record(row.seq, np.asarray([row.position]), out["experts"][:, r][None])
        computed: dict[int, tuple[Sequence, int]] = {}
        for ch in plan.chunks:
            computed[id(ch.seq)] = (ch.seq, ch.stop)
        for row in plan.rows:
            computed[id(row.seq)] = (row.seq, row.position + 1)
        for seq, stop in computed.values():
            seq.num_computed = stop
            if seq.sample_index is None and stop == seq.target:
                shared = len(seq.table.pages)
                children = self.scheduler.fork(seq)
                self.pages_shared += (len(children) - 1) * shared
        for (out, r), row in zip(results, plan.rows, strict=True):
            if not row.sample:
                continue
            seq = row.seq
            s = seq.request.sampling
            token = int(out["tokens"][r])
            key = (
                "logprob_sampler" if s.logprob_policy == "sampler" else "logprob_temperature_scaled"
            )
            seq.tokens.append(token)
            seq.logprobs.append(float(out[key][r]))
            seq.versions.append(seq.weights)
            self.generated_tokens += 1
            reason = None
            if token in s.stop_token_ids or (token in self.eos_ids and not s.ignore_eos):
                reason = FinishReason.EOS
            elif (s.stop_sequences or s.stop) and self._stopped(seq.sampled, s):
                reason = FinishReason.STOP
            elif len(seq.sampled) >= s.max_new_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                self.scheduler.finish(seq)
                finished.append(self._rollout(seq, reason))
        return finished

    def _stopped(self, sampled: list[int], s: SamplingParams) -> bool:
        """Whether the token just sampled completed one of ``s``'s stop sequences or strings.
        A string is looked for in the text of the last tokens (as many as its characters, and
        a few more for tokens that decode to nothing): checked after every token, it is found
        at the first token that completes it."""
        for q in s.stop_sequences:
            if len(sampled) >= len(q) and tuple(sampled[-len(q) :]) == q:
                return True
        if not s.stop:
            return False
        window = max(len(x) for x in s.stop) + _STOP_SLACK_TOKENS
        text = self.detokenize(sampled[-window:])
        return any(x in text for x in s.stop)

    def _rollout(self, seq: Sequence, reason: FinishReason) -> Rollout:
        s = seq.request.sampling
        return Rollout(
            prompt_id=seq.request.prompt_id,
            sample_index=seq.sample_index,
            prompt_tokens=np.asarray(seq.request.prompt_tokens, np.int32),
            tokens=np.asarray(seq.sampled, np.int32),
            logprobs=np.asarray(seq.logprobs, np.float32),
            versions=np.asarray(seq.versions, np.int64),
            finish_reason=reason,
            logprob_policy=s.logprob_policy,
            # Every position of the sequence: prompt, continuation, tokens (the last one never
            # ran, -1).
            routes=None if seq.routes is None else seq.routes[: len(seq.tokens)].copy(),
        )

    def run(self) -> list[Rollout]:
        """Steps until every submitted request has finished."""
        done: list[Rollout] = []
        while self.has_work():
            done += self.step()
        return done

    # -- weights ------------------------------------------------------------------------------

    def abort_all(self) -> list[Rollout]:
        """Removes every request; returns one ABORTED rollout per sample (not-yet-forked groups
        give G rollouts with no tokens), so nothing disappears."""
        self._older = None
        return self._aborted(self.scheduler.remove_all())

    def _aborted(self, seqs: list[Sequence]) -> list[Rollout]:
        out = []
        for seq in seqs:
            if seq.sample_index is None:
                out += [
                    self._rollout(
                        dataclasses.replace(seq, sample_index=i, tokens=list(seq.tokens)),
                        FinishReason.ABORTED,
                    )
                    for i in range(seq.request.num_samples)
                ]
            else:
                out.append(self._rollout(seq, FinishReason.ABORTED))
        return out

    def load_weights(self, version: int, params: Any) -> list[Rollout]:
        """Serves ``params`` (an ``nnx.State`` of the model, or its pure-dict form) as ``version``
        from the next step on. Returns the aborted rollouts (module docstring: none with
        ``continue_on_reload``; with ``overlap_reload`` those of an older version still
        running)."""
        state = self._place(self._as_state(params))
        aborted: list[Rollout] = []
        if self.cfg.continue_on_reload:
            for seq in self.scheduler.all_sequences():
                seq.weights = version
        elif self.cfg.overlap_reload and version == self.version:
            pass  # the same version again (a failover's reload): everything runs on
        elif self.cfg.overlap_reload:
            older = self.older_version
            if older == version:  # back to the older one: its sequences run on the new copy
                for seq in self.scheduler.all_sequences():
                    if seq.weights == older:
                        seq.weights = version
            elif older is not None:  # one older copy at most: its sequences give way
                aborted = self._aborted(self.scheduler.remove_on({older}))
                logging.getLogger(__name__).warning(
                    "loading version %d while version %d still ran %d samples on older "
                    "weights: they are aborted (one older version is kept)",
                    version,
                    older,
                    len(aborted),
                )
            self._older = (self.version, self.state)
        else:
            aborted = self.abort_all()
        self.scheduler.kept.clear(self.allocators)  # their keys/values are the old weights'
        self.state, self.version = state, version
        self.scheduler.weights = version
        self._drop_unused_older()
        return aborted

    def _drop_unused_older(self) -> None:
        """Lets the older weights go once no sequence runs on them."""
        if self._older is not None and not any(
            s.weights == self._older[0] for s in self.scheduler.all_sequences()
        ):
            self._older = None

    def _as_state(self, params: Any) -> nnx.State:
        if isinstance(params, dict) and not isinstance(params, nnx.State):
            self._check_whole_or_adapters(params)
            state = jax.tree.map(lambda x: x, self.state)
            try:
                nnx.replace_by_pure_dict(state, params)
            except (KeyError, ValueError, TypeError) as e:
                raise InvalidWeights(f"weights do not fit the model: {e}") from e
            params = state
        ours = jax.tree.structure(self.state)
        if jax.tree.structure(params) != ours:
            raise InvalidWeights("weights have a different parameter tree than the served model")
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(self.state), jax.tree.leaves(params), strict=True
        ):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise InvalidWeights(
                    f"{jax.tree_util.keystr(path)}: expected {a.dtype}{list(a.shape)}, got "
                    f"{b.dtype}{list(b.shape)}"
                )
        return jax.tree.map(jnp.asarray, params)

    def _check_whole_or_adapters(self, params: dict) -> None:
        """A pure dict must be the whole model or, for a LoRA model, its adapters alone (a LoRA
        run publishes those; the base stays as loaded): any other part would leave the rest of
        the old version in place unnoticed."""
        ours = nnx.to_pure_dict(jax.tree.map(lambda a: 0, self.state))
        adapters, _ = split_adapters(ours)
        allowed = [_leaf_paths(ours)] + ([_leaf_paths(adapters)] if adapters else [])
        if _leaf_paths(params) not in allowed:
            raise InvalidWeights(
                "weights must hold every parameter of the model"
                + (" or exactly its LoRA adapters" if adapters else "")
            )

    def stats(self) -> EngineStats:
        return EngineStats(
            version=self.version,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            pages_total=sum(a.num_pages - 1 for a in self.allocators),
            pages_free=sum(a.num_free for a in self.allocators),
            compilations=self.compilations,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            preemptions=self.scheduler.num_preemptions,
            pages_shared=self.pages_shared,
            prefix_tokens_reused=self.scheduler.kept.reused_tokens,
            rows_bitwise=self.rows_bitwise,
        )
