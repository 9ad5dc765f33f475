"""Continuous batching on the host: which tokens of which sequences run in the next engine step.

An engine step runs up to two programs of fixed shapes:

* the *prefill* program, [``prefill_rows``, ``prefill_len``]: prompt chunks that only write keys
  and values (no logits). A sequence's prompt prefix, positions 0..P-2 (P = prompt length), is
  cut into chunks at fixed boundaries, [kC, (k+1)C) with C = ``prefill_len``, whatever else runs,
  so a replay can cut it the same way. Several chunks of one sequence may share a call (each
  attends to the keys the earlier ones wrote in the same layer). ``prefill_rows = 0`` turns the
  program off: prompts then go through decode rows like any other token.
* the *decode* program, ``step_tokens`` rows of one token each: a decoding sequence takes one row;
  a sequence recomputing generated tokens after preemption takes up to ``prefill_chunk`` rows at
  consecutive positions.
Because the shapes never change, steady state never recompiles, and a token's logits do not
depend on which other rows share the step.

Life of a request with G samples: its prompt is admitted as one *parent* sequence that prefills
positions 0..P-2 (the prompt but its last token); then it forks into G *sample* sequences sharing
those pages, each of which feeds the last prompt token at P-1 (copy-on-write of the shared partial
page) and samples its own first token with its own RNG stream. Admission needs G free slots
(``max_concurrent_seqs``) and pages for the prompt.

Preemption by recompute: when a sequence needs a page and none is free, the most recently
admitted sequence not yet planned this step is evicted (its pages released) and re-queued at the
front with the tokens it already generated; on readmission it re-feeds them (the prompt prefix as
prefill chunks at the same boundaries, the rest as rows, no sampling until it is past them).
Recomputed keys/values are bitwise the originals (same programs, same chunks; rows rounded
alike, ``Engine.rows_bitwise``), so preemption never changes outputs. One sequence of maximal length always fits (checked at construction), so
the oldest sequence always progresses: no deadlock.

Kept pages (``Request.keep_pages``, prefix_cache.py): a finished sample's pages may stay for the
request that continues its sequence; at admission that request takes the longest kept entry its
tokens start with (on that entry's shard, waiting for a row there) and computes only the positions
after it, at the positions and with the programs it would have used anyway. Kept pages are
evicted, oldest first, before any running sequence is preempted.

Data shards (one page allocator per shard, D > 1): the decode rows and the prefill rows are D
contiguous blocks of ``step_tokens / D`` and ``prefill_rows / D``, and shard s's sequences take
rows of block s and pages of allocator s only (page ids local to the shard). A sequence is
placed at admission on the shard with the most free pages (then the fewest used slots, then the
lowest index) whose rows have room for its slots; its samples stay on its shard (they share its
pages). A preemption evicts the newest unplanned sequence of the shard that ran out of pages;
readmitted, the sequence is placed anew. Everything above then holds per shard.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Collection

import numpy as np

from rlax_tpu.inference.pages import BlockTable, OutOfPages, PageAllocator
from rlax_tpu.inference.prefix_cache import Entry, PrefixCache
from rlax_tpu.inference.sampler import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One prompt to sample ``num_samples`` completions of (the GRPO group of size G)."""

    prompt_id: str
    prompt_tokens: tuple[int, ...]
    num_samples: int = 1
    sampling: SamplingParams = SamplingParams()
    # Tokens after the prompt that each sample already holds (a multi-turn episode's earlier
    # turns and the environment's replies): fed like a preempted sequence's generated tokens
    # (decode rows, never sampled or reported), so their keys and values are bitwise those of
    # an uninterrupted sequence; sampling starts after them.
    continuation: tuple[int, ...] = ()
    # Keep each sample's pages when it finishes, for a request continuing it (the next turn of
    # an episode) to take instead of recomputing them (``prefix_cache.py``).
    keep_pages: bool = False
    # Requests of one session (an episode's turns) go to one worker of a pool, whose engine may
    # still hold the pages of the earlier turns. Routing only: never sent to a worker.
    session: str = ""


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample (``sample_index`` >= 0) or a group's shared-prompt parent (``sample_index`` None)."""

    request: Request
    sample_index: int | None
    tokens: list[int]  # prompt + generated
    table: BlockTable
    order: int  # admission order: lower = older = higher priority
    shard: int = 0  # the data shard whose rows and pages the sequence uses (set at admission)
    num_computed: int = 0  # positions whose keys/values are in the cache
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    # The weight version it runs on (the engine's at submission; an overlapped reload keeps the
    # older weights for the sequences started on them).
    weights: int = 0
    # A MoE model's experts of each position computed so far [cache positions, L, k] int16, -1
    # where none was (the engine records them; routing replay). None: a dense model.
    routes: np.ndarray | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def generated(self) -> list[int]:
        """The tokens after the prompt: the request's continuation, then the sampled ones."""
        return self.tokens[self.num_prompt :]

    @property
    def sampled(self) -> list[int]:
        """The tokens this sequence sampled (after the continuation)."""
        return self.tokens[self.num_prompt + len(self.request.continuation) :]

    @property
    def target(self) -> int:
        """Positions to compute before the next event: the parent stops before the last prompt
        token (its samples feed it); a sample computes through its last token and samples."""
        return self.num_prompt - 1 if self.sample_index is None else len(self.tokens)

    @property
    def slots(self) -> int:
        return self.request.num_samples if self.sample_index is None else 1


@dataclasses.dataclass
class Row:
    seq: Sequence
    position: int
    token: int
    sample: bool  # its logits choose the sequence's next token


@dataclasses.dataclass
class Chunk:
    """Prompt positions [start, stop) of a sequence for the prefill program (stop - start <= C)."""

    seq: Sequence
    start: int
    stop: int


@dataclasses.dataclass
class Plan:
    rows: list[Row]
    copies: list[tuple[int, int]]  # page copies (src, dst) to apply before the step
    preempted: int  # sequences evicted while planning
    chunks: list[Chunk] = dataclasses.field(default_factory=list)  # run before the rows


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator | list[PageAllocator],
        *,
        page_size: int,
        max_seqs: int,
        step_tokens: int,
        prefill_chunk: int,
        prefill_rows: int = 0,
        prefill_len: int = 1,
    ):
        if step_tokens < max_seqs:
            raise ValueError(f"step_tokens ({step_tokens}) must be >= max_seqs ({max_seqs})")
        if prefill_rows < 0 or prefill_len < 1:
            raise ValueError(
                f"prefill_rows ({prefill_rows}) must be >= 0 and prefill_len ({prefill_len}) >= 1"
            )
        # One allocator per data shard (module docstring); one: a single pool.
        self.allocators = [allocator] if isinstance(allocator, PageAllocator) else allocator
        d = self.shards
        if step_tokens % d or prefill_rows % d:
            raise ValueError(
                f"inference.mesh.data = {d} splits the decode and prefill rows into {d} blocks: "
                f"step_tokens ({step_tokens}) and prefill_rows ({prefill_rows}) must divide by {d}"
            )
        self.page_size = page_size
        self.max_seqs, self.step_tokens, self.prefill_chunk = max_seqs, step_tokens, prefill_chunk
        self.prefill_rows, self.prefill_len = prefill_rows, prefill_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._order = itertools.count()
        self.num_preemptions = 0
        self.kept = PrefixCache(page_size)
        # The served weights' version: only its sequences keep pages or take kept ones.
        self.weights = 0

    # -- queue --------------------------------------------------------------------------------

    def add(self, request: Request, weights: int | None = None) -> None:
        """Queues ``request`` to run on weights ``weights`` (default: the served ones)."""
        seq = self._parent(request)
        seq.weights = self.weights if weights is None else weights
        self.waiting.append(seq)

    def _parent(self, request: Request) -> Sequence:
        return Sequence(request, None, list(request.prompt_tokens), BlockTable(self.page_size), -1)

    @property
    def shards(self) -> int:
        return len(self.allocators)

    @property
    def used_slots(self) -> int:
        return sum(s.slots for s in self.running)

    def shard_slots(self, shard: int) -> int:
        return sum(s.slots for s in self.running if s.shard == shard)

    def alloc(self, seq: Sequence) -> PageAllocator:
        """The allocator of ``seq``'s shard."""
        return self.allocators[seq.shard]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def remove_all(self) -> list[Sequence]:
        """Takes every sequence out (releasing pages); returns them, running first."""
        out = self.all_sequences()
        for s in self.running:
            s.table.release(self.alloc(s))
        self.running, self.waiting = [], collections.deque()
        self.kept.clear(self.allocators)
        return out

    def remove_on(self, weights: Collection[int]) -> list[Sequence]:
        """Takes the sequences running on ``weights`` out (releasing pages); returns them,
        running first."""
        out = [s for s in self.all_sequences() if s.weights in weights]
        for s in self.running:
            if s.weights in weights:
                s.table.release(self.alloc(s))
        self.running = [s for s in self.running if s.weights not in weights]
        self.waiting = collections.deque(s for s in self.waiting if s.weights not in weights)
        return out

    # -- planning -------------------------------------------------------------------------------

    def prefix(self, seq: Sequence) -> int:
        """Positions the prefill program computes: the prompt but its last token (0 when off)."""
        return seq.num_prompt - 1 if self.prefill_rows else 0

    def _pages_to_admit(self, seq: Sequence) -> int:
        first = min(seq.target, self.prefill_len if self.prefill_rows else self.prefill_chunk)
        extra = seq.request.num_samples if seq.sample_index is None else 0
        return -(-first // self.page_size) + extra

    def _place(self, seq: Sequence) -> int | None:
        """The shard to admit ``seq`` on (module docstring), or None: no shard has room for its
        slots in its rows."""
        rows = self.step_tokens // self.shards
        fits = [s for s in range(self.shards) if self.shard_slots(s) + seq.slots <= rows]
        if not fits:
            return None
        return min(fits, key=lambda s: (-self.allocators[s].num_free, self.shard_slots(s), s))

    def _reusable(self, seq: Sequence) -> tuple[Entry, int] | None:
        """A kept entry ``seq`` starts with and the positions of it to take: all but the last
        token (which samples), at a chunk boundary while in the prefill program's prefix."""
        if not len(self.kept) or seq.weights != self.weights:
            return None
        full = (
            seq.tokens if seq.sample_index is not None else [*seq.tokens, *seq.request.continuation]
        )
        entry = self.kept.find(full)
        if entry is None:
            return None
        n = min(len(entry.tokens), len(full) - 1)
        if n < self.prefix(seq):
            n -= n % self.prefill_len
        return (entry, n) if n > 0 else None

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if self.used_slots + seq.slots > self.max_seqs:
                return
            reuse = self._reusable(seq)
            if reuse:
                # Wait for a row on the shard that kept the pages rather than recompute them.
                shard = reuse[0].shard
                if self.shard_slots(shard) + seq.slots > self.step_tokens // self.shards:
                    return
            else:
                shard = self._place(seq)
            if shard is None:
                return
            busy = any(s.shard == shard for s in self.running)
            alloc, need = self.allocators[shard], self._pages_to_admit(seq)
            if need > alloc.num_free:
                self.kept.evict(alloc, shard, need, spare=reuse[0] if reuse else None)
            if need > alloc.num_free and busy:
                return
            self.waiting.popleft()
            seq.shard = shard
            seq.order = next(self._order)
            seq.num_computed = 0
            if reuse:
                seq.table.pages = self.kept.take(reuse[0], alloc, reuse[1])
                seq.num_computed = reuse[1]
                if reuse[0].routes is not None:  # the kept positions' experts come along
                    seq.routes = reuse[0].routes.copy()
                    seq.routes[reuse[1] :] = -1
            self.running.append(seq)
            if seq.sample_index is None and seq.num_computed >= seq.target:
                self.fork(seq)  # nothing left to share-compute (a one-token prompt, kept pages)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.table.release(self.alloc(seq))
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def plan(self) -> Plan:
        """The chunks and rows of the next step (oldest sequences first), allocating their
        pages. A sequence with prompt chunks in this step gets no rows in it. With data shards
        each shard has its own row budgets, and ``Plan.copies`` hold shard s's page p as
        s * (its allocator's num_pages) + p."""
        self._admit()
        rows: list[Row] = []
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []
        preempted = 0
        budget = [self.step_tokens // self.shards] * self.shards
        chunk_budget = [self.prefill_rows // self.shards] * self.shards
        queue = sorted(self.running, key=lambda s: s.order)
        i = 0
        while i < len(queue) and (any(budget) or any(chunk_budget)):
            seq = queue[i]
            shard, alloc = seq.shard, self.alloc(seq)
            start, prefix = seq.num_computed, self.prefix(seq)
            if start < prefix:  # start is a chunk boundary: chunks are computed whole
                n = min(chunk_budget[shard], -(-(prefix - start) // self.prefill_len))
                stop = min(prefix, start + n * self.prefill_len)
            else:
                n, stop = 0, min(seq.target, start + min(budget[shard], self.prefill_chunk))
            if stop <= start:
                i += 1
                continue
            local: list[tuple[int, int]] = []
            try:
                seq.table.prepare_write(alloc, start, stop, local)
            except OutOfPages:
                if self.kept.evict(alloc, shard, seq.table.pages_needed(alloc, start, stop)):
                    continue  # kept pages go before any running sequence does
                # The newest not yet planned of this shard (possibly seq itself): only its pages
                # can free this shard's.
                last = max(j for j in range(i, len(queue)) if queue[j].shard == shard)
                self._preempt(queue.pop(last))
                preempted += 1
                continue
            first = shard * alloc.num_pages
            copies += [(first + src, first + dst) for src, dst in local]
            if n:
                for a in range(start, stop, self.prefill_len):
                    chunks.append(Chunk(seq, a, min(stop, a + self.prefill_len)))
                chunk_budget[shard] -= n
            else:
                for p in range(start, stop):
                    rows.append(Row(seq, p, seq.tokens[p], sample=p == len(seq.tokens) - 1))
                budget[shard] -= stop - start
            i += 1
        return Plan(rows, copies, preempted, chunks)

    # -- results ----------------------------------------------------------------------------------

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Replaces a prefilled parent by its samples, which share its pages."""
        self.running.remove(parent)
        children = []
        for i in range(parent.request.num_samples):
            child = Sequence(
                parent.request,
                i,
                [*parent.tokens, *parent.request.continuation],
                parent.table.fork(self.alloc(parent)),
                parent.order,
                shard=parent.shard,  # its pages are the parent's
                num_computed=parent.num_computed,
                weights=parent.weights,
                routes=None if parent.routes is None else parent.routes.copy(),
            )
            children.append(child)
        parent.table.release(self.alloc(parent))
        self.running.extend(children)
        return children

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.request.keep_pages and seq.sample_index is not None and seq.weights == self.weights:
            self.kept.put(
                self.alloc(seq),
                seq.shard,
                seq.tokens[: seq.num_computed],
                seq.table.pages,
                routes=seq.routes,
            )
            seq.table.pages = []
        else:
            seq.table.release(self.alloc(seq))

    def check_invariants(self) -> None:
        """No page leaks: each shard's reference counts equal the pages its running sequences
        hold; no shard has more slots than rows."""
        for shard, alloc in enumerate(self.allocators):
            held = [s.table.pages for s in self.running if s.shard == shard]
            alloc.check_no_leaks(held + self.kept.held(shard))
            if self.shard_slots(shard) > self.step_tokens // self.shards:
                raise AssertionError(f"shard {shard}: more slots than its rows")
        if any(s.table.pages for s in self.waiting):
            raise AssertionError("a waiting sequence holds pages")
        if self.used_slots > self.max_seqs:
            raise AssertionError(f"{self.used_slots} slots used, max {self.max_seqs}")


def block_table_rows(rows: list[Row] | list[Chunk], width: int, pad_to: int) -> np.ndarray:
    """[pad_to, width] int32 block tables of the rows or chunks (null page for padding)."""
    out = np.zeros((pad_to, width), np.int32)
    cache: dict[int, np.ndarray] = {}
    for r, row in enumerate(rows):
        key = id(row.seq)
        if key not in cache:
            cache[key] = row.seq.table.row(width)
        out[r] = cache[key]
    return out
