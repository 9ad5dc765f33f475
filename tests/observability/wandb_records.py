"""Reads back what W&B wrote offline: the records of a run's ``.wandb`` files, decoded with W&B's
own record schema (``wandb.proto.wandb_internal_pb2.Record``).

The client has no Python reader (its Go core reads them when syncing). The file is W&B's header
(``:W&B``, a 2-byte magic 0xBEE1, a version byte) then LevelDB's log format: 32 KiB blocks of
chunks, each a checksum (4 bytes), a length (2), a type (1: full, 2: first, 3: middle, 4: last)
and the data; a block's tail shorter than a chunk header is padding (LevelDB's
doc/log_format.md). W&B's checksum is the plain CRC-32 (zlib's) of the type byte and the data,
where LevelDB masks a CRC-32C (found by reading a file W&B 0.31 wrote). Every chunk's checksum
is checked, so a misread fails instead of decoding noise.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

BLOCK = 32 * 1024
HEADER = b":W&B" + struct.pack("<H", 0xBEE1)
_CHUNK = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    """The records of one ``.wandb`` file, as bytes; a torn tail (a killed writer) is left."""
    data = path.read_bytes()
    assert data[:6] == HEADER, f"{path}: not a W&B transaction log ({data[:7]!r})"
    out, parts, pos = [], [], 7
    while pos + _CHUNK <= len(data):
        left = BLOCK - pos % BLOCK
        if left < _CHUNK:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK])
        body = data[pos + _CHUNK : pos + _CHUNK + length]
        if kind == 0 and length == 0:  # preallocated zeros: the end of what was written
            break
        if len(body) < length:
            break  # torn tail
        assert zlib.crc32(bytes([kind]) + body) == crc, f"{path} @ {pos}: checksum"
        pos += _CHUNK + length
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            parts = [body]
        elif kind == _MIDDLE:
            parts.append(body)
        elif kind == _LAST:
            out.append(b"".join([*parts, body]))
            parts = []
    return out


def _kinds(path: Path) -> list[str]:
    from wandb.proto import wandb_internal_pb2

    out = []
    for blob in payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob)
        out.append(record.WhichOneof("record_type"))
    return out


def wait_finished(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Waits until every offline run under ``run_dir`` holds its exit record: ``finish()``
    returns before W&B's service process has written its file's tail."""
    deadline = time.monotonic() + timeout_s
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    while not all("exit" in _kinds(f) for f in files):
        assert time.monotonic() < deadline, f"no exit record in {files} after {timeout_s} s"
        time.sleep(0.1)


def history(run_dir: Path) -> list[tuple[str, int, dict]]:
    """Every history row in W&B's offline runs under ``run_dir``: (run id, step, {key: value}),
    in the order the runs were started and each logged them."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run_id = ""
        for blob in payloads(f):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(blob)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                row = {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.append((run_id, int(record.history.step.num), row))
    return rows


def config(run_dir: Path) -> dict:
    """The run config W&B recorded: every key of every offline run's updates, in order."""
    from wandb.proto import wandb_internal_pb2

    out: dict = {}
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for blob in payloads(f):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(blob)
            kind = record.WhichOneof("record_type")
            updates = record.run.config.update if kind == "run" else record.config.update
            if kind in ("run", "config"):
                out |= {item.key: json.loads(item.value_json) for item in updates}
    return out
