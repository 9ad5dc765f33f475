"""Read access to a GGUF file: metadata fields and lazily dequantized tensors.

The header is parsed here with ``struct`` (the format: magic "GGUF", version 2 or 3, tensor and
key-value counts, typed key-values, tensor infos, then aligned tensor data; ggml's
docs/gguf.md). ``gguf.GGUFReader`` builds a numpy view per element, about 2 CPU-s for
SmolLM2's 49,152 tokens and 48,900 merges, and a run read the file three times (its config,
tokenizer and weights); this reads the same header in about a tenth of it. Dequantization is
still the ``gguf`` package's.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from rlax_tpu.models.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format (little-endian); 8 (string) and 9 (array) are read apart.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# Unquantized tensor types as numpy dtypes; the others are bytes, a row of blocks.
_PLAIN = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    """A tensor's index entry. ``shape`` is GGUF's order (fastest-varying first); ``data`` is
    a view of the file: the values for unquantized types, else uint8 of shape
    (..., rows, bytes a row) as ``gguf.quants.dequantize`` takes it."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.at = 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buf[self.at : self.at + n], "utf-8")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, n = self.take("<I"), self.take("<Q")
            if inner == _STRING:
                return [self.string() for _ in range(n)]
            if inner not in _SCALARS:
                raise ValueError(f"array of unsupported value type {inner}")
            fmt = _SCALARS[inner]
            values = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.at))
            self.at += n * struct.calcsize(fmt)
            return values
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.take(_SCALARS[kind])


class GGUFFile:
    """A parsed GGUF file: metadata fields and lazily dequantized tensors."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if not Path(path).is_file():
            raise ModelLoadError(self.path, "file not found")
        try:
            self.fields, self.tensors = self._parse()
        except (ValueError, struct.error, KeyError, OverflowError) as e:
            raise ModelLoadError(
                self.path, f"not a valid GGUF file ({type(e).__name__}: {e})"
            ) from None

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
        with open(self.path, "rb") as fh:
            if Path(self.path).stat().st_size == 0:
                raise ValueError("empty file")
            raw = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(memoryview(raw))
        if bytes(cur.buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        cur.at = 4
        version = cur.take("<I")
        if version not in VERSIONS:
            raise ValueError(f"version {version} (this reader takes {VERSIONS}, little-endian)")
        num_tensors, num_fields = cur.take("<Q"), cur.take("<Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cur.string()
            fields[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            infos.append((name, gguf.GGMLQuantizationType(cur.take("<I")), dims, cur.take("<Q")))
        align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        start = -(-cur.at // align) * align
        whole = np.frombuffer(raw, np.uint8)
        tensors: dict[str, GGUFTensor] = {}
        for name, kind, dims, offset in infos:
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            shape = tuple(reversed(dims))  # numpy order
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims, dtype=np.int64))
            n_bytes = count // block * block_bytes
            begin = start + offset
            if begin + n_bytes > len(whole):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            data = whole[begin : begin + n_bytes]
            if kind in _PLAIN:
                data = data.view(_PLAIN[kind]).reshape(shape)
            else:
                data = data.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            tensors[name] = GGUFTensor(name, kind, dims, data)
        return fields, tensors

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

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
        if t.tensor_type in _PLAIN:
            return np.asarray(t.data, np.float32)
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(self.path, f"cannot dequantize tensor {name!r} ({e})") from None
        return np.asarray(data, np.float32).reshape(tuple(reversed(t.shape)))
