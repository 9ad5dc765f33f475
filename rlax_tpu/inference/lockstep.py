"""One engine over several hosts: the lead process's engine calls, replayed by every follower.

A worker whose mesh spans the processes of a ``jax.distributed`` job runs one :class:`Engine` per
process, and every process must launch the same programs in the same order. Only the lead
(process 0) serves callers; before each engine step it broadcasts what changed since the last
one (requests submitted, a weight version loaded, shutdown) and every follower applies the same
calls and steps too. The engine is deterministic given its calls (scheduling, sampling seeds),
so the processes stay in step without exchanging anything else.

    commands = [("submit", request, version), ("stage", version), ("load", version), ("abort",),
                ("profile", run_dir, step, start), ("step",), ("stop",)]

Followers stage ("stage": fetch ahead, inference/standby.py) and load a version from their own
weight source (the parameter server), so every process
pulls its weights itself; loading is a collective, so a round's loads are first agreed
(:func:`agree_on_loads`): a version some process could not fetch is loaded by none, and the
lead's caller is told which process lacked it. Any other failure, on any process, ends every
process (``multihost.fail``): a step's outcome is not exchanged (a decode step takes
milliseconds, a host round trip per step would cost as much), so a process cannot know whether
the others failed alike, and a worker whose processes diverged must not serve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from rlax_tpu import multihost
from rlax_tpu.observability.profiles import PROFILER

Command = tuple[Any, ...]


def is_multi_process() -> bool:
    return jax.process_count() > 1


def broadcast(commands: list[Command] | None) -> list[Command]:
    """The lead's ``commands`` on every process (followers pass None). A collective: every
    process of the job must call it, the same number of times."""
    return multihost.broadcast(commands)


def agree_on_loads(versions: list[int], errors: list[str | None]) -> dict[int, str]:
    """Before a round's loads of ``versions``: every process says which it could not fetch
    (``errors``, None: fetched). The versions no process loads, with why ("process 1:
    UnknownVersion: ..."). Every process calls it for each round with loads."""
    refused: dict[int, list[str]] = {}
    for p, theirs in enumerate(multihost.exchange(errors)):
        for version, why in zip(versions, theirs, strict=True):
            if why is not None:
                refused.setdefault(version, []).append(f"process {p}: {why}")
    return {version: "; ".join(whys) for version, whys in refused.items()}


def follow(
    engine: Any,
    fetch: Callable[[int], Any],
    stage: Callable[[int], None] | None = None,
    loaded: Callable[[], None] | None = None,
) -> int:
    """A follower's loop: applies the lead's broadcast commands to ``engine`` until "stop";
    ``fetch(version)`` gives a version's weights, ``stage(version)`` starts fetching it ahead
    (applied before the round's loads; None: "stage" is ignored), ``loaded()`` is told once a
    round's loads are swapped in and the engine keeps no older version. Returns the steps
    taken."""
    me, steps = jax.process_index(), 0
    standby_waits = False
    while True:
        try:
            commands = broadcast(None)
        except Exception as e:  # noqa: BLE001 - the key-value store (in the lead) is gone
            multihost.fail(f"lost the lead (process 0) waiting for its next step: {e}")
        with multihost.bounded("inference step"):  # the lead's: worker.py
            if stage is not None:  # before this round's loads: a version staged and loaded in one
                for command in commands:  # round is fetched once, by the load
                    if command[0] == "stage":
                        stage(command[1])
            weights = _fetch_agreed([c[1] for c in commands if c[0] == "load"], fetch)
            for command in commands:
                kind = command[0]
                try:
                    if kind == "submit":
                        engine.submit(*command[1:])
                    elif kind == "stage":
                        pass  # staged above
                    elif kind == "load":
                        if command[1] in weights:
                            engine.load_weights(command[1], weights[command[1]])
                    elif kind == "profile":  # (run_dir, step, start): never fails
                        _, run_dir, step, start = command
                        (PROFILER.start if start else PROFILER.stop)(run_dir, step, "inference")
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
                except Exception as e:  # noqa: BLE001 - the job must not go on out of step
                    multihost.fail(
                        f"inference {kind} failed on process {me}: {type(e).__name__}: {e}"
                    )
        standby_waits |= any(c[0] == "load" for c in commands)
        if loaded is not None and standby_waits and getattr(engine, "older_version", None) is None:
            # This round's versions are swapped in and no older one is kept for its sequences
            # (the lead's rule, worker.py): the next may be staged.
            standby_waits = False
            loaded()


def _fetch_agreed(versions: list[int], fetch: Callable[[int], Any]) -> dict[int, Any]:
    """The weights of this round's ``versions`` that every process fetched."""
    if not versions:
        return {}
    weights, errors = {}, []
    for version in versions:
        try:
            weights[version] = fetch(version)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - told to every process, the lead's caller gets it
            errors.append(f"{type(e).__name__}: {e}")
    refused = agree_on_loads(versions, errors)
    return {v: w for v, w in weights.items() if v not in refused}
