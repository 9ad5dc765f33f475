"""Host-side bookkeeping of the paged KV cache: a free list, reference counts and block tables.

The device holds ``num_pages`` pages of ``page_size`` token slots per layer; this module decides
which page holds which tokens of which sequence. Page 0 is the *null page*: it is never handed
out, stays all zeros, and fills the unused tail of every block table, so a gather through a block
table always reads finite values (masked out by position anyway).

Prefix sharing: the G samples of one prompt :meth:`PageAllocator.fork` the prompt's pages (the
reference count goes up instead of copying). A sample about to write into a page that others still
hold gets a private copy first (copy-on-write, :meth:`BlockTable.prepare_write`); the device copy
is queued as a (src, dst) pair for the engine to apply before the step that writes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated."""


class PageAllocator:
    """Fixed-size pages with a LIFO free list and reference counts."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)
        self.refcount[NULL_PAGE] = 1  # pinned forever
        # Pop from the end: low page ids first (deterministic placement, easier debugging).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages held by sequences (the null page excluded)."""
        return self.num_pages - 1 - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """Another holder for ``pages`` (no copy)."""
        for p in pages:
            if self.refcount[p] <= 0 or p == NULL_PAGE:
                raise ValueError(f"page {p} is not allocated")
            self.refcount[p] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0 or p == NULL_PAGE:
                raise ValueError(f"page {p} released more often than held")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def check_no_leaks(self, held: list[list[int]]) -> None:
        """Raises AssertionError unless the reference counts equal the holdings in ``held``."""
        expected = np.zeros(self.num_pages, np.int32)
        expected[NULL_PAGE] = 1
        for pages in held:
            np.add.at(expected, np.asarray(pages, np.int64), 1)
        if not np.array_equal(expected, self.refcount):
            bad = np.nonzero(expected != self.refcount)[0][:8]
            raise AssertionError(f"page refcounts disagree with holders at pages {bad.tolist()}")
        if sorted(self._free) != [int(p) for p in np.nonzero(self.refcount == 0)[0]]:
            raise AssertionError("free list disagrees with reference counts")


@dataclasses.dataclass
class BlockTable:
    """The pages of one sequence, in position order: position p lives in
    ``pages[p // page_size]`` at slot ``p % page_size``."""

    page_size: int
    pages: list[int] = dataclasses.field(default_factory=list)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def fork(self, allocator: PageAllocator) -> BlockTable:
        return BlockTable(self.page_size, allocator.share(self.pages))

    def pages_needed(self, allocator: PageAllocator, start: int, stop: int) -> int:
        """Free pages that :meth:`prepare_write` of positions [start, stop) would take."""
        new = max(0, -(-stop // self.page_size) - len(self.pages))
        first = start // self.page_size
        shared = sum(
            1
            for i in range(first, min(len(self.pages), -(-stop // self.page_size)))
            if allocator.refcount[self.pages[i]] > 1
        )
        return new + shared

    def prepare_write(
        self, allocator: PageAllocator, start: int, stop: int, copies: list[tuple[int, int]]
    ) -> None:
        """Makes positions [start, stop) writable: new pages at the end, private copies of shared
        pages (their device copy appended to ``copies`` as (src, dst)). All or nothing: raises
        OutOfPages before changing anything if the free pages do not suffice."""
        if stop <= start:
            return
        need = self.pages_needed(allocator, start, stop)
        if need > allocator.num_free:
            raise OutOfPages(f"need {need} pages, {allocator.num_free} free")
        first, last = start // self.page_size, (stop - 1) // self.page_size
        for i in range(first, min(len(self.pages), last + 1)):
            src = self.pages[i]
            if allocator.refcount[src] > 1:
                (dst,) = allocator.allocate(1)
                copies.append((src, dst))
                allocator.release([src])
                self.pages[i] = dst
        self.pages += allocator.allocate(max(0, last + 1 - len(self.pages)))

    def release(self, allocator: PageAllocator) -> None:
        allocator.release(self.pages)
        self.pages = []

    def row(self, width: int) -> np.ndarray:
        """[width] int32: the page ids padded with the null page."""
        out = np.full(width, NULL_PAGE, np.int32)
        out[: len(self.pages)] = self.pages
        return out
