"""A worker's epochs and the holds that keep them open (controller/epochs.py), without workers:
the waits are the subject."""

from __future__ import annotations

import threading

import pytest

from rlax_tpu.controller.epochs import Epochs, Hold


def test_holds_met_in_opposite_orders_on_two_workers_do_not_wait_for_each_other():
    """Hold A (older) keeps an epoch on worker 1 before B's there, B one on worker 0 before A's
    (two steps' first turns, or a failover, reach the workers in different orders). Once their
    first jobs end, B's idle epoch on worker 0 gives way to A's waiting job; A's on worker 1
    does not give way to B's (younger), whose job runs once A is released: no cycle."""
    epochs = [Epochs(exclusive=True), Epochs(exclusive=True)]
    a, b = Hold(0, epochs), Hold(0, epochs)
    assert a.seq < b.seq
    b0, a1 = b.join(0), a.join(1)  # the first jobs: each at the head of its worker
    a0, b1 = a.join(0), b.join(1)  # the later ones, each behind the other hold's epoch
    assert epochs[0].wait_turn(b0) and epochs[1].wait_turn(a1)
    assert a0 is not b0 and b1 is not a1  # exclusive: each hold an epoch of its own
    epochs[1].leave(a1, a.seq)  # A's first job ends: A keeps worker 1, B waits
    epochs[0].leave(b0, b.seq)  # B's first job ends: B's kept epoch gives way to A's job
    assert epochs[0].wait_turn(a0)
    blocked = threading.Thread(target=epochs[1].wait_turn, args=(b1,), daemon=True)
    blocked.start()
    blocked.join(timeout=0.3)
    assert blocked.is_alive()  # B's job waits for A, the older hold
    epochs[0].leave(a0, a.seq)
    a.release()
    blocked.join(timeout=10)
    assert not blocked.is_alive()
    # B's later job on worker 0 opens a new epoch there: its kept one gave way.
    assert b.join(0) is not b0
    b.release()


def _runs(epochs: Epochs, epoch, wait: float = 0.3) -> bool:
    """Whether ``epoch``'s turn comes within ``wait`` seconds (the waiter is left behind if not:
    a later change lets it through, or the test's close ends it)."""
    t = threading.Thread(target=epochs.wait_turn, args=(epoch,), daemon=True)
    t.start()
    t.join(timeout=wait)
    return not t.is_alive()


def test_with_overlap_the_next_epoch_starts_once_the_heads_jobs_are_queued_two_at_most():
    """The epoch after the head starts once every job of the head is queued in the engine (not
    when the head ends), for a newer version only; the head is sealed then (a job of its version
    opens a new epoch), and a third epoch waits for the head to end. A hold keeping the head
    keeps the next one out."""
    epochs = Epochs(overlap=True)
    head = epochs.join(0)
    assert epochs.join(0) is head  # two jobs of version 0
    v1 = epochs.join(1)
    assert epochs.wait_turn(head)
    epochs.queued(head)
    assert not _runs(epochs, v1)  # one job of the head is not queued yet
    epochs.queued(head)
    assert _runs(epochs, v1, wait=10) and head.sealed
    again = epochs.join(0)  # version 0 again: not into the sealed head
    assert again is not head and again is not v1
    assert _runs(epochs, v1, wait=10)  # v1's later jobs run beside the head too
    assert not _runs(epochs, again)  # a third epoch waits for the head to end
    epochs.leave(head)
    epochs.leave(head)
    epochs.queued(v1)
    assert not _runs(epochs, again)  # forward only: back to version 0 waits for v1 to end
    epochs.leave(v1)
    assert _runs(epochs, again, wait=10)
    epochs.queued(again)
    v2 = epochs.join(2)
    assert _runs(epochs, v2, wait=10)  # forward again: beside version 0's queued job
    epochs.close()

    kept = Epochs(overlap=True)
    hold = Hold(0, [kept])
    first = hold.join(0)
    newer = kept.join(1)
    kept.queued(first)  # its job runs, queued: only the hold keeps the next epoch out
    assert not _runs(kept, newer)  # the hold's later turns run on version 0's epoch first
    hold.release()
    assert _runs(kept, newer, wait=10) and first.sealed  # beside the hold's running job
    kept.close()


def test_overlap_and_exclusive_epochs_are_refused_together():
    with pytest.raises(ValueError, match="exclusive"):
        Epochs(exclusive=True, overlap=True)
