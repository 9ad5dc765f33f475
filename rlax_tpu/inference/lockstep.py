"""One engine over several hosts: the lead process's engine calls, replayed by every follower.

A worker whose mesh spans the processes of a ``jax.distributed`` job runs one :class:`Engine` per
process, and every process must launch the same programs in the same order. Only the lead
(process 0) serves callers; before each engine step it broadcasts what changed since the last
one (requests submitted, a weight version loaded, shutdown) and every follower applies the same
calls and steps too. The engine is deterministic given its calls (scheduling, sampling seeds),
so the processes stay in step without exchanging anything else.

    commands = [("submit", request), ("load", version), ("abort",), ("step",), ("stop",)]

Followers load a version from their own weight source (the parameter server), so every process
pulls its weights itself.
"""

from __future__ import annotations

from typing import Any

import jax

from rlax_tpu import multihost

Command = tuple[Any, ...]


def is_multi_process() -> bool:
    return jax.process_count() > 1


def broadcast(commands: list[Command] | None) -> list[Command]:
    """The lead's ``commands`` on every process (followers pass None). A collective: every
    process of the job must call it, the same number of times."""
    return multihost.broadcast(commands)


def follow(engine: Any, fetch: Any) -> int:
    """A follower's loop: applies the lead's broadcast commands to ``engine`` until "stop";
    ``fetch(version)`` gives a version's weights. Returns the steps taken."""
    steps = 0
    while True:
        for command in broadcast(None):
            kind = command[0]
            if kind == "submit":
                engine.submit(command[1])
            elif kind == "load":
                engine.load_weights(command[1], fetch(command[1]))
            elif kind == "abort":
                engine.abort_all()
            elif kind == "step":
                if engine.has_work():
                    engine.step()
                    steps += 1
            elif kind == "stop":
                return steps
            else:
                raise ValueError(f"unknown lockstep command {kind!r}")
