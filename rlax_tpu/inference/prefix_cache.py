"""Pages of finished sequences kept for the request that continues them (multi-turn episodes).

A sample whose request says ``keep_pages`` does not release its pages when it finishes: they go
here with the tokens whose keys and values they hold (every position but the last sampled token,
which was never fed). A later request whose prompt + continuation starts with those tokens takes
them at admission and computes only the positions after them; the rest of its sequence is the one
it would have computed anyway, with the same programs at the same positions, so its keys, values,
tokens and log-probs are bitwise those of recomputing (``Engine.rows_bitwise``). An entry is used
once (a continuation owns its pages after that), is dropped when the weights change (its keys
and values belong to the old ones), and is evicted, oldest first, when a shard runs short of pages:
keeping pages never preempts a running sequence.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from rlax_tpu.inference.pages import PageAllocator


@dataclasses.dataclass
class Entry:
    shard: int
    tokens: tuple[int, ...]  # positions 0..len-1 whose keys/values ``pages`` hold
    pages: list[int]
    routes: np.ndarray | None = None  # a MoE model's experts of those positions (Sequence.routes)


class PrefixCache:
    """Kept entries, oldest first; a lookup finds the longest entry a token list starts with."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._entries: collections.OrderedDict[tuple[int, ...], Entry] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()
        self.reused_tokens = 0  # positions continuations took instead of recomputing

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        allocator: PageAllocator,
        shard: int,
        tokens: list[int],
        pages: list[int],
        *,
        routes: np.ndarray | None = None,
    ) -> None:
        """Keeps ``pages`` (their references pass to the cache) holding ``tokens``' keys/values;
        pages past the tokens are released. An entry for the same tokens is replaced."""
        n = -(-len(tokens) // self.page_size)
        allocator.release(pages[n:])
        if not tokens:
            return
        key = tuple(tokens)
        old = self._entries.pop(key, None)
        if old is not None:
            self._lengths[len(key)] -= 1
            allocator.release(old.pages)
        self._entries[key] = Entry(shard, key, pages[:n], routes)
        self._lengths[len(key)] += 1

    def find(self, tokens: list[int]) -> Entry | None:
        """The longest entry that ``tokens`` starts with (not removed)."""
        for n in sorted(
            (n for n, c in self._lengths.items() if c and n <= len(tokens)), reverse=True
        ):
            entry = self._entries.get(tuple(tokens[:n]))
            if entry is not None:
                return entry
        return None

    def take(self, entry: Entry, allocator: PageAllocator, length: int) -> list[int]:
        """Removes ``entry``; returns its pages holding positions [0, ``length``) with a reference
        for the caller (the others are released)."""
        del self._entries[entry.tokens]
        self._lengths[len(entry.tokens)] -= 1
        n = -(-length // self.page_size)
        allocator.release(entry.pages[n:])
        self.reused_tokens += length
        return entry.pages[:n]

    def evict(
        self, allocator: PageAllocator, shard: int, need: int, *, spare: Entry | None = None
    ) -> bool:
        """Drops ``shard``'s entries (but ``spare``), oldest first, until ``allocator`` has
        ``need`` free pages or none is left; True if it dropped any."""
        dropped = False
        for key in [k for k, e in self._entries.items() if e.shard == shard and e is not spare]:
            if allocator.num_free >= need:
                break
            allocator.release(self._entries.pop(key).pages)
            self._lengths[len(key)] -= 1
            dropped = True
        return dropped

    def clear(self, allocators: list[PageAllocator]) -> None:
        for entry in self._entries.values():
            allocators[entry.shard].release(entry.pages)
        self._entries.clear()
        self._lengths.clear()

    def held(self, shard: int) -> list[list[int]]:
        """The page lists ``shard``'s entries hold (for the leak check)."""
        return [e.pages for e in self._entries.values() if e.shard == shard]
