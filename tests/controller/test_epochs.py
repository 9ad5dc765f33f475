"""A worker's epochs and the holds that keep them open (controller/epochs.py), without workers:
the waits are the subject."""

from __future__ import annotations

import threading

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
