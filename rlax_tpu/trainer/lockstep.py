"""One trainer over several hosts: the lead process's calls, replayed by every follower.

A trainer whose mesh spans the processes of a ``jax.distributed`` job runs one :class:`Trainer`
per process, and every process must run the same programs in the same order. Only the lead
(process 0) serves gRPC; each call that runs device programs (a train step, publish, save,
restore) is first broadcast with its arguments (the batch included) and every follower makes the
same call. The trainer is deterministic given its calls, so nothing else is exchanged but how
each call ended (``multihost.agree``), before the next one is broadcast: a call that failed on
every process is answered to the caller as one process's error would be (a bad batch, no
checkpoint to restore), one that failed on only some ends every process, naming them. Each
process publishes the parameter slices it owns (a version in parts) and checkpoints its shards.

    lead = LeadTrainer(trainer)     # process 0: serve(lead, ...); lead.stop() when done
    follow(trainer)                 # every other process: until the lead stops
"""

from __future__ import annotations

import logging
from typing import Any

from rlax_tpu import multihost

log = logging.getLogger(__name__)

# The Trainer calls that run device programs (every process must make them).
COLLECTIVE_CALLS = ("train_step", "publish", "save", "restore")


class LeadTrainer:
    """Process 0's trainer: a collective call goes to the followers, then runs here; everything
    else (status, params) is this process's own."""

    def __init__(self, trainer: Any):
        self._trainer = trainer

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._trainer, name)
        if name not in COLLECTIVE_CALLS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            multihost.broadcast(("call", name, args, kwargs))
            try:
                with multihost.bounded(f"trainer call {name}"):
                    result = attr(*args, **kwargs)
            except Exception as e:
                multihost.agree(f"trainer call {name}", e)  # returns if it failed everywhere
                raise
            multihost.agree(f"trainer call {name}", None)
            return result

        return call

    def stop(self) -> None:
        """Releases the followers (they return from ``follow``)."""
        multihost.broadcast(("stop",))


def follow(trainer: Any) -> int:
    """A follower's loop: makes the lead's collective calls on ``trainer`` until it stops;
    returns the calls made. A call that failed here and on every other process is the lead's
    to answer; one that failed on only some processes ends this one (``multihost.agree``), as
    does losing the lead."""
    calls = 0
    while True:
        try:
            command = multihost.broadcast(None)
        except Exception as e:  # noqa: BLE001 - the key-value store (in the lead) is gone
            multihost.fail(f"lost the lead (process 0) waiting for its next call: {e}")
        if command[0] == "stop":
            return calls
        _, name, args, kwargs = command
        error = None
        try:
            if name not in COLLECTIVE_CALLS:
                raise ValueError(f"unknown trainer call {name!r} from the lead")
            with multihost.bounded(f"trainer call {name}"):
                getattr(trainer, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - told to every process by agree
            error = e
        multihost.agree(f"trainer call {name}", error)
        if error is not None:
            log.warning(
                "trainer call %s failed on every process (the lead answers): %s", name, error
            )
        calls += 1
