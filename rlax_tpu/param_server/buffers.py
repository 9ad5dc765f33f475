"""Host memory for whole versions: one slab per version, carved into aligned arrays, recycled.

A version's arrays are received into one slab: an anonymous memory map carved into 64-byte
aligned arrays (jax on CPU then uses them without a copy). Its pages are faulted in by the copies
that fill it, which release the GIL, and only as far as data arrives: neither ``MAP_POPULATE`` nor
``madvise(MADV_POPULATE_WRITE)``, which hold the GIL for the whole range (80 ms for 270 MB here:
every other thread of the server, pulls included, would stall) and would let a header alone
commit the memory it declares; nor numpy's transparent-huge-page advice, whose compaction stalls
took 0.2-0.7 s per 270 MB allocation here. A slab whose arrays nobody references any more (the
server collected the version and TensorStore dropped the data it held by reference; a client's
caller dropped the arrays) is reused as it is, its pages already in place: in steady state a
version costs no new memory and no page faults.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Sequence

import numpy as np

ALIGN = 64
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """(byte offset of each array, slab size) with every offset a multiple of ALIGN."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


class SlabPool:
    """Slabs handed out for versions being received, and recycled once nothing uses them.

    A slab is idle when the pool holds the only reference to its memory map: every array carved
    from it references it (through numpy's ``base`` chain), and so does whoever keeps such an
    array (TensorStore for data it holds by reference, jax for a host array it aliases), so a
    slab in use can never be handed out again, nor unmapped. Every ``take`` (and ``trim``) unmaps
    idle slabs beyond ``max_idle``.
    """

    def __init__(self, *, max_idle: int = 1):
        self.max_idle = max_idle
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.reused = 0  # slabs handed out again, for tests and metrics

    def _idle(self, k: int) -> bool:
        return sys.getrefcount(self._maps[k]) == 2  # the list's reference and the argument

    def take(self, nbytes: int) -> np.ndarray:
        """A page-aligned uint8 buffer of ``nbytes``: an idle slab of that size, or a new one.

        Idle slabs beyond ``max_idle`` are unmapped on every call, so memory left idle after a
        burst (several versions held at once, then dropped) goes back at the next take.
        """
        size = max(nbytes, 1)
        with self._lock:
            out = None
            for k in range(len(self._maps)):
                if len(self._maps[k]) == size and self._idle(k):
                    self.reused += 1
                    out = np.frombuffer(self._maps[k], np.uint8)[:nbytes]  # no longer idle
                    break
            self._trim_locked()  # before allocating: the new slab's pages may reuse freed ones
            if out is None:
                self._maps.append(mmap.mmap(-1, size, flags=_FLAGS))
                out = np.frombuffer(self._maps[-1], np.uint8)[:nbytes]
            return out

    def trim(self) -> None:
        """Unmaps idle slabs beyond ``max_idle``."""
        with self._lock:
            self._trim_locked()

    def _trim_locked(self) -> None:
        idle = [k for k in range(len(self._maps)) if self._idle(k)]
        for k in reversed(idle[self.max_idle :]):
            del self._maps[k]  # unmapped when the last reference goes, which is this one

    def held(self) -> tuple[int, int]:
        """(slabs, idle slabs) the pool holds."""
        with self._lock:
            return len(self._maps), sum(self._idle(k) for k in range(len(self._maps)))
