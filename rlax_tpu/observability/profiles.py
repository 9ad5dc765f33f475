"""Profiles on demand (observability.profile_steps): a ``jax.profiler`` trace of chosen steps,
from every process that does their work, written beside the run.

JAX runs one trace at a time in a process, and one process may hold several components (the
local transport: the trainer and the workers in the controller's process). So a process traces
once for every component that asks: the first :meth:`Profiler.start` of a step starts the trace,
the last :meth:`Profiler.stop` ends it, and the trace goes to
``<run_dir>/profiles/step_<s>/<host>.<pid>/`` (TensorBoard's layout: ``plugins/profile/<time>/
<host>.xplane.pb``; view with ``tensorboard --logdir <run_dir>/profiles/step_<s>`` and its
profile plugin, or XProf), with ``components.json`` naming the components it covered. The
trace is written to a local directory first and copied there (a gs:// run directory too).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from rlax_tpu import storage

PROFILES_DIR = "profiles"
COMPONENTS_FILE = "components.json"

log = logging.getLogger(__name__)


def step_dir(run_dir: str | Path, step: int) -> storage.epath.Path:
    return storage.path(run_dir) / PROFILES_DIR / f"step_{step:06d}"


def process_name() -> str:
    return f"{socket.gethostname()}.{os.getpid()}"


class Profiler:
    """This process's traces; thread-safe (components call it from their own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, set[str]] = {}  # step -> components tracing it
        self._covered: dict[int, set[str]] = {}  # step -> every component that asked
        self._tmp: dict[int, str] = {}
        self._tracing: int | None = None  # the step the running trace is of

    def start(self, run_dir: str | Path, step: int, component: str) -> None:
        """``component`` wants step ``step`` traced (from now to its :meth:`stop`)."""
        import jax

        with self._lock:
            if self._tracing is not None and self._tracing != step:
                log.warning(
                    "%s: not tracing step %d: this process traces step %d still",
                    component,
                    step,
                    self._tracing,
                )
                return
            self._active.setdefault(step, set()).add(component)
            self._covered.setdefault(step, set()).add(component)
            if self._tracing is None:
                tmp = tempfile.mkdtemp(prefix=f"rlax_profile_{step}_")
                try:
                    jax.profiler.start_trace(tmp)
                except Exception as e:  # noqa: BLE001 - a profile never stops the work
                    log.warning(
                        "%s: cannot trace step %d: %s: %s", component, step, type(e).__name__, e
                    )
                    shutil.rmtree(tmp, ignore_errors=True)
                    del self._active[step], self._covered[step]
                    return
                self._tmp[step], self._tracing = tmp, step

    def stop(self, run_dir: str | Path, step: int, component: str) -> storage.epath.Path | None:
        """``component`` is done with step ``step``; the last one's stop ends the trace and
        copies it beside the run. Returns where it went (None: the trace goes on, or none)."""
        import jax

        with self._lock:
            active = self._active.get(step)
            if not active or component not in active:
                return None
            active.discard(component)
            if active or self._tracing != step:
                return None
            self._tracing = None
            tmp = self._tmp.pop(step)
            covered = sorted(self._covered.pop(step))
            del self._active[step]
            dest = step_dir(run_dir, step) / process_name()
            try:
                jax.profiler.stop_trace()
                _copy_tree(Path(tmp), dest)
                storage.write_atomic(dest / COMPONENTS_FILE, json.dumps({"components": covered}))
            except Exception as e:  # noqa: BLE001 - a profile never stops the work
                log.warning("the trace of step %d is lost: %s: %s", step, type(e).__name__, e)
                return None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("profile of step %d (%s) in %s", step, ", ".join(covered), dest)
        return dest


def _copy_tree(src: Path, dest: storage.epath.Path) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_file():
            target = dest / path.relative_to(src).as_posix()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())


PROFILER = Profiler()  # the process's one
