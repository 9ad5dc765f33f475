"""One path layer for everything a run reads and writes: local files and ``gs://`` alike.

    storage.path("gs://bucket/runs/x") / "metrics.jsonl"    an etils.epath.Path (gcsfs for gs://)
    storage.write_atomic(p, data)                           readers never see half a file
    storage.local_copy(p)                                   a local file or folder for libraries
                                                            that need one (safetensors, GGUF, BPE)
    storage.read_ranges(p, [(start, end), ...])             byte ranges of a file (ranged GETs
                                                            on GCS, fetched concurrently)

Local paths are made absolute (``~`` expanded), so a process that changes directory keeps
writing where it started. Orbax and TensorStore (trainer checkpoints, the parameter server's
persistence) open ``gs://`` through their own GCS drivers.

An emulator (tests; ``gcp-storage-emulator``) is named by ``STORAGE_EMULATOR_HOST``, which gcsfs
and google-cloud-storage read; :func:`use_emulator_if_set` points TensorStore's GCS driver at the
same address (``TENSORSTORE_GCS_HTTP_URL``) so every library writes to one place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from etils import epath

REMOTE_PREFIXES = ("gs://",)
CACHE_ENV = "RLAX_CACHE_DIR"  # where remote weights and tokenizers are copied (local_copy)


def use_emulator_if_set() -> None:
    """With ``STORAGE_EMULATOR_HOST`` set, TensorStore's GCS driver talks to that emulator too
    (unless ``TENSORSTORE_GCS_HTTP_URL`` names another), and gcsfs stops warning on every call
    that it found no Google credentials (an emulator needs none)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    url = host if host.startswith("http") else f"http://{host}"
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    for name in ("gcsfs", "google.auth"):
        logging.getLogger(name).setLevel(logging.ERROR)


def is_remote(p: str | os.PathLike) -> bool:
    return str(p).startswith(REMOTE_PREFIXES)


def path(p: str | os.PathLike) -> epath.Path:
    """``p`` as an epath.Path: gs:// as given, local paths absolute."""
    text = os.fspath(p)
    if is_remote(text):
        use_emulator_if_set()
        return epath.Path(text)
    return epath.Path(Path(text).expanduser().absolute())


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base / parts`` as a string (gs:// kept intact, unlike pathlib, which folds ``//``)."""
    return os.fspath(path(base).joinpath(*parts))


def write_atomic(target: str | os.PathLike, data: bytes | str) -> None:
    """Writes ``data`` so that readers see the old contents or the new, never a part: locally a
    temporary file renamed over the target; on GCS one object upload (objects appear whole)."""
    target = path(target)
    raw = data.encode() if isinstance(data, str) else data
    if is_remote(target):
        target.write_bytes(raw)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.fspath(target.parent), prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.fspath(target))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _files_under(folder: epath.Path) -> list[epath.Path]:
    # iterdir, not rglob or walk: epath refuses recursive globs on GCS and walk drops "gs://".
    out = []
    for child in folder.iterdir():
        out += _files_under(child) if child.is_dir() else [child]
    return out


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlax_tpu").expanduser()


def local_copy(p: str | os.PathLike) -> Path:
    """A local path with ``p``'s contents: ``p`` itself when local; a remote file or folder is
    copied once into :func:`cache_dir` (keyed by its path; files whose size changed are copied
    again) and the copy returned. Raises FileNotFoundError for a path that does not exist."""
    src = path(p)
    if not is_remote(src):
        if not src.exists():
            raise FileNotFoundError(f"{src} does not exist")
        return Path(os.fspath(src))
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    key = hashlib.sha256(os.fspath(src).encode()).hexdigest()[:16]
    dest = cache_dir() / key / src.name
    for f in _files_under(src) if src.is_dir() else [src]:
        out = dest if f == src else dest / os.fspath(f.relative_to(src))
        if out.exists() and out.stat().st_size == f.stat().length:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.part")
        with f.open("rb") as r, tmp.open("wb") as w:
            while chunk := r.read(64 * 2**20):
                w.write(chunk)
        tmp.replace(out)
    if src.is_dir():
        dest.mkdir(parents=True, exist_ok=True)
    return dest


def read_ranges(p: str | os.PathLike, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes ``[start, end)`` of the file ``p`` for each of ``ranges``, in order. On GCS each
    range is one ranged GET, all of them in flight at once (gcsfs ``cat_ranges``): a reader that
    needs parts of a large object (per-host checkpoint loading) never fetches the rest. Raises
    FileNotFoundError for a file that does not exist."""
    if not ranges:
        return []
    if not is_remote(p):
        with open(os.fspath(path(p)), "rb") as f:
            out = []
            for start, end in ranges:
                f.seek(start)
                out.append(f.read(end - start))
            return out
    import fsspec  # epath's own GCS backend (gcsfs): the same client, config and emulator

    use_emulator_if_set()
    fs = fsspec.filesystem("gs")
    starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
    return fs.cat_ranges([os.fspath(p)] * len(ranges), starts, ends, on_error="raise")
