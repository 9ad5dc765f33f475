"""Zarr3 arrays on a TensorStore kvstore: the hot store (``memory``) and the persistent one
(``file`` here, ``gs://`` in production) share this code; only the kvstore spec differs.

Keys: ``<prefix>/a<i>/`` holds array i of a version, ``<prefix>/manifest.json`` its manifest.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from rlax_tpu.param_server.codec import ArraySpec, VersionManifest, chunk_shape, np_dtype

MANIFEST = "manifest.json"
INTENT = "intent.json"  # the manifest, written first: what a torn copy was going to hold


def kvstore_spec(location: str) -> dict:
    """A kvstore spec for ``memory``, a ``gs://`` / ``file://`` URL, or a local directory."""
    if location == "memory":
        return {"driver": "memory"}
    if "://" not in location:
        location = "file://" + os.path.abspath(location)
    return ts.KvStore.Spec(location.rstrip("/") + "/").to_json()


class ArrayStore:
    """Versions' arrays under one kvstore root. Thread-safe (TensorStore is)."""

    def __init__(self, location: str, *, copy_threads: int = 4):
        self.location = location
        self._base = kvstore_spec(location)
        # Own context: a memory kvstore is private to it, and copies use a few threads.
        self._context = ts.Context({"data_copy_concurrency": {"limit": copy_threads}})
        self._kv = ts.KvStore.open(self._base, context=self._context).result()
        self._open: dict[tuple[str, int], ts.TensorStore] = {}  # handles, to skip re-opening
        self._lock = threading.Lock()

    def _array_spec(self, prefix: str, i: int) -> dict:
        path = self._base.get("path", "") + f"{prefix}/a{i}/"
        return {"driver": "zarr3", "kvstore": {**self._base, "path": path}}

    def create_array(self, prefix: str, i: int, spec: ArraySpec) -> ts.Future:
        """Starts creating array i (a new zarr array) under ``prefix``; the future gives its handle.

        Creating is separate from writing so that a version's arrays can all be created at once,
        while their bytes are still arriving, instead of one blocking open per array.
        """
        chunks = chunk_shape(spec)
        return ts.open(
            self._array_spec(prefix, i),
            create=True,
            delete_existing=True,
            dtype=ts.dtype(spec.dtype),
            shape=list(spec.shape),
            chunk_layout=ts.ChunkLayout(chunk_shape=chunks) if chunks else None,
            context=self._context,
        )

    def write_created(
        self, prefix: str, i: int, store: ts.TensorStore, spec: ArraySpec, data: np.ndarray
    ) -> ts.Future:
        """Starts writing ``data`` into array i, created by ``create_array``; returns the future.

        ``data`` is handed over: the store may keep referencing it instead of copying it (10x
        faster into a memory kvstore), so the caller must never modify it afterwards.
        """
        with self._lock:
            self._open[(prefix, i)] = store
        return store.write(data.reshape(spec.shape), can_reference_source_data_indefinitely=True)

    def write_array(self, prefix: str, i: int, spec: ArraySpec, data: np.ndarray) -> ts.Future:
        """Creates array i under ``prefix`` and starts writing ``data`` (handed over, as in
        ``write_created``); returns the write future."""
        store = self.create_array(prefix, i, spec).result()
        return self.write_created(prefix, i, store, spec, data)

    def _view(
        self, prefix: str, i: int, spec: ArraySpec, bounds: Sequence[tuple[int, int]] | None
    ) -> ts.TensorStore:
        """Array i of ``prefix`` (checked against ``spec``), or its index box ``bounds``."""
        with self._lock:
            store = self._open.get((prefix, i))
        if store is None:
            spec_json = self._array_spec(prefix, i)
            store = ts.open(spec_json, open=True, context=self._context).result()
        if store.dtype.numpy_dtype != np_dtype(spec.dtype) or tuple(store.shape) != spec.shape:
            raise OSError(f"{self.location}/{prefix}/a{i} does not hold {spec.dtype}{spec.shape}")
        if bounds is not None:
            store = store[tuple(slice(lo, hi) for lo, hi in bounds)]
        return store

    def read_array(
        self, prefix: str, i: int, spec: ArraySpec, bounds: Sequence[tuple[int, int]] | None = None
    ) -> ts.Future:
        """Starts reading array i, or the index box ``bounds`` of it; the future gives numpy."""
        return self._view(prefix, i, spec, bounds).read()

    def read_into(
        self,
        prefix: str,
        i: int,
        spec: ArraySpec,
        bounds: Sequence[tuple[int, int]] | None,
        out: np.ndarray,
    ) -> ts.Future:
        """Starts reading array i (or the box ``bounds`` of it) straight into ``out``, a writable
        C-order array of that shape and dtype: one copy out of the store, no new memory."""
        source = self._view(prefix, i, spec, bounds)
        return ts.array(out, copy=False, write=True).write(source)

    def write_manifest(
        self, prefix: str, manifest: VersionManifest, *, name: str = MANIFEST
    ) -> None:
        self._kv.write(f"{prefix}/{name}", manifest.to_json()).result()

    def read_manifest(self, prefix: str, *, name: str = MANIFEST) -> VersionManifest | None:
        got = self._kv.read(f"{prefix}/{name}").result()
        return VersionManifest.from_json(got.value) if got.state == "value" else None

    def manifest_prefixes(self) -> list[str]:
        """Prefixes that hold a manifest (committed or not yet verified)."""
        suffix = f"/{MANIFEST}".encode()
        return sorted(
            k[: -len(suffix)].decode() for k in self._kv.list().result() if k.endswith(suffix)
        )

    def prefixes(self) -> set[str]:
        """Top-level prefixes that hold any key (committed, staged or partial)."""
        return {k.decode().split("/", 1)[0] for k in self._kv.list().result()}

    def delete(self, prefix: str) -> None:
        """Deletes everything under ``prefix/``, manifest first so a half-deleted one is not taken."""
        with self._lock:
            self._open = {k: v for k, v in self._open.items() if k[0] != prefix}
        self._kv.delete_range(
            ts.KvStore.KeyRange(f"{prefix}/{MANIFEST}", f"{prefix}/{MANIFEST}\0")
        ).result()
        self._kv.delete_range(ts.KvStore.KeyRange(f"{prefix}/", f"{prefix}0")).result()
        if self._base.get("driver") == "file":  # the file kvstore leaves empty directories
            _remove_empty_dirs(os.path.join(self._base["path"], prefix))


def _remove_empty_dirs(root: str) -> None:
    for path, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):  # deepest first
        with contextlib.suppress(OSError):  # not empty (a concurrent write): leave it
            os.rmdir(path)
