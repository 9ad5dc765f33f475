"""Read access to a GGUF file: metadata fields and lazily dequantized tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from rlax_tpu.models.errors import ModelLoadError


class GGUFFile:
    """A parsed GGUF file: metadata fields and lazily dequantized tensors."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if not Path(path).is_file():
            raise ModelLoadError(self.path, "file not found")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises bare ValueError/IndexError on bad bytes
            raise ModelLoadError(
                self.path, f"not a valid GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def require(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise ModelLoadError(self.path, f"metadata field {key!r} is missing")
        return value

    def tensor(self, name: str) -> np.ndarray | None:
        """Dequantized f32 tensor in numpy (row-major) order, or None if absent."""
        t = self.tensors.get(name)
        if t is None:
            return None
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(self.path, f"cannot dequantize tensor {name!r} ({e})") from None
        return np.asarray(data, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
