"""The verifier's own scratch directory, and the start-up sweep of dead verifiers' ones.

A verifier that owns its scratch (no ``scratch_dir`` given) makes ``<tmp>/rlax-verifier-*`` and
removes it on close. One that is SIGKILLed cannot, and each run left compiled programs, test
data and outputs behind (216 directories, 1.5 GB on one host after a day of tests). So every
owned directory records its owner (pid and the process's start time, which tells a reused pid
apart), and a new verifier removes the directories whose owner no longer runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "rlax-verifier-"
OWNER_FILE = ".owner"


def process_start(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot (/proc/<pid>/stat field 22), or None if no
    such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)" start at field 3


def make_owned(root: str | os.PathLike | None = None) -> Path:
    """A new scratch directory under ``root`` (default: the temp dir) owned by this process."""
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    path.chmod(0o700)
    (path / OWNER_FILE).write_text(f"{os.getpid()} {process_start(os.getpid())}\n")
    return path


def sweep_dead(root: str | os.PathLike | None = None) -> list[Path]:
    """Removes the scratch directories under ``root`` whose owner is gone; returns them.
    Directories without an owner file (being created, or not ours) are left alone."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            pid, start = (path / OWNER_FILE).read_text().split()
            alive = process_start(int(pid)) == start
        except (OSError, ValueError):
            continue
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info(
            "verifier: removed %d scratch directories of verifiers that no longer run", len(removed)
        )
    return removed
