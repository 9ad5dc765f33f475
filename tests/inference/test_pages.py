"""Page allocator: free list, reference counts, copy-on-write, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from rlax_tpu.inference.pages import NULL_PAGE, BlockTable, OutOfPages, PageAllocator


def test_allocate_release_and_null_page():
    a = PageAllocator(5)
    pages = a.allocate(4)
    assert NULL_PAGE not in pages and sorted(pages) == [1, 2, 3, 4] and a.num_free == 0
    with pytest.raises(OutOfPages):
        a.allocate(1)
    a.release(pages)
    assert a.num_free == 4 and a.num_used == 0
    with pytest.raises(ValueError, match="released more often"):
        a.release([pages[0]])
    a.check_no_leaks([])


def test_fork_shares_full_pages_and_copies_the_partial_one_on_write():
    a = PageAllocator(16)
    parent = BlockTable(4)
    parent.prepare_write(a, 0, 10, [])  # 3 pages, the last one partial
    kids = [parent.fork(a) for _ in range(3)]
    parent.release(a)
    assert a.num_used == 3 and all(k.pages == kids[0].pages for k in kids)
    copies: list[tuple[int, int]] = []
    for k in kids:
        k.prepare_write(a, 10, 11, copies)
    # Two private copies of the partial page; the last holder writes in place.
    assert len(copies) == 2 and {src for src, _ in copies} == {kids[2].pages[2]}
    assert kids[0].pages[:2] == kids[1].pages[:2] == kids[2].pages[:2]
    assert len({k.pages[2] for k in kids}) == 3
    a.check_no_leaks([k.pages for k in kids])
    for k in kids:
        k.release(a)
    a.check_no_leaks([])


def test_prepare_write_is_all_or_nothing():
    a = PageAllocator(4)
    t = BlockTable(2)
    t.prepare_write(a, 0, 4, [])
    u = t.fork(a)
    before = (list(t.pages), a.num_free, a.refcount.copy())
    with pytest.raises(OutOfPages):
        u.prepare_write(a, 2, 8, [])  # a copy of page 1 and two new pages: 3 > 1 free
    assert (list(t.pages), a.num_free) == before[:2] and (a.refcount == before[2]).all()
