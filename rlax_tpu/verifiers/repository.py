"""Content-addressed store of test data and checker sources (RLAX §6.1: upload once, refer by link).

A link is ``sha256:<64 hex digits>`` of the content, so the same data uploaded twice is stored once,
links never go stale, and a request cannot name a path (links are validated before use). Files are
written atomically and read-only; sandboxes see single files through read-only bind mounts.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rlax_tpu.verifiers.api import UnknownLink

_LINK = re.compile(r"^sha256:([0-9a-f]{64})$")


def link_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Repository:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def _path(self, link: str) -> Path:
        m = _LINK.match(link)
        if not m:
            raise UnknownLink(f"not a repository link: {link[:80]!r}")
        digest = m.group(1)
        return self.root / digest[:2] / digest[2:]

    def upload(self, data: bytes) -> str:
        link = link_of(data)
        path = self._path(link)
        if path.exists():
            return link
        path.parent.mkdir(exist_ok=True)
        os.chmod(path.parent, 0o755)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
        return link

    def upload_file(self, path: Path) -> str:
        return self.upload(Path(path).read_bytes())

    def path(self, link: str) -> Path:
        """The file holding ``link``'s content. Raises UnknownLink."""
        path = self._path(link)
        if not path.is_file():
            raise UnknownLink(f"{link} is not in the repository; upload it first")
        return path

    def read(self, link: str) -> bytes:
        return self.path(link).read_bytes()

    def missing(self, links: Sequence[str]) -> list[str]:
        out = []
        for link in links:
            try:
                self.path(link)
            except UnknownLink:
                out.append(link)
        return out
