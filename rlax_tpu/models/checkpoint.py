"""Build a model from named HF-layout tensors, and the HF safetensors reader / writer.

Tensors go straight from host memory into (possibly sharded) device arrays: with a mesh, each
device receives only its slice (``jax.make_array_from_callback``); no full replica is made on
any device.

A checkpoint on gs:// is read in place (:class:`RemoteSafetensors`), never copied whole to each
host: each file's header by a ranged read, then with a mesh every host fetches only the rows of
each tensor (in the file's layout) that its devices hold in a row split over the whole mesh, and
the devices turn those into the parameter's layout and sharding (transpose, head split, dtype)
in one jitted reshard. Each host reads about 1/hosts of the data, in contiguous ranges, whatever
the parameter sharding: the parameters' own slices would often be strided (fsdp splits the
inner dim of most HF [out, in] matrices: one small GET per row).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from rlax_tpu import storage
from rlax_tpu.config import ModelConfig
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.hf_format import (
    TensorMapping,
    _same,
    _transpose,
    config_from_hf,
    config_to_hf,
    tensor_mappings,
)
from rlax_tpu.models.layers import LoRAParam, lora_initial
from rlax_tpu.models.sharding import logical_sharding
from rlax_tpu.models.transformer import Transformer

# (hf_name) -> host array in HF layout, or None if the checkpoint lacks it.
TensorGetter = Callable[[str], np.ndarray | None]

_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

log = logging.getLogger(__name__)


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model's structure with shape-only parameters (allocates nothing)."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def build_model(
    cfg: ModelConfig,
    get: TensorGetter,
    source: str,
    mesh: Mesh | None = None,
    *,
    names: Collection[str] | None = None,
) -> Transformer:
    """A model whose every parameter comes from ``get`` (HF names and layouts).

    ``names``: every tensor name in the checkpoint; one the config does not map is an error (a
    silently dropped tensor means wrong logits, e.g. an ``lm_head`` when the config says tied).
    Raises ModelLoadError naming ``source`` and the tensor if one is missing, mis-shaped or unused.
    """
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = dict(nnx.to_flat_state(state))
    dtype = _NP_DTYPES[cfg.param_dtype]
    mappings = tensor_mappings(cfg)
    if names is not None:
        _check_all_used(cfg, get, source, names, {n for m in mappings for n in m.hf_names})
    for m in mappings:
        var = flat[m.path]
        value = _host_value(m, get, source).astype(dtype)
        flat[m.path] = var.replace(_to_device(value, var, mesh))
    _init_adapters(cfg, flat, mesh)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _host_value(m: TensorMapping, get: TensorGetter, source: str) -> np.ndarray:
    """The parameter's value from its HF tensor (or, for experts, its HF tensors stacked)."""
    parts = []
    for name in m.hf_names:
        host = get(name)
        _check_shape(source, m, None if host is None else tuple(host.shape), name)
        parts.append(np.asarray(m.to_model(host)))
    return np.stack(parts) if m.experts else parts[0]


def _init_adapters(cfg: ModelConfig, flat: dict, mesh: Mesh | None) -> None:
    """LoRA adapters are not in a base checkpoint: they start as ``init_model`` starts them."""
    for path, var in flat.items():
        if isinstance(var, LoRAParam):
            value = np.asarray(lora_initial(cfg, path, var.shape))
            flat[path] = var.replace(_to_device(value, var, mesh))


def _check_shape(
    source: str, m: TensorMapping, shape: tuple[int, ...] | None, name: str | None = None
) -> None:
    name = name or m.hf_name
    if shape is None:
        raise ModelLoadError(source, f"tensor {name!r} is missing from the checkpoint")
    if shape != m.hf_shape:
        raise ModelLoadError(
            source, f"tensor {name!r} has shape {shape}, the config expects {m.hf_shape}"
        )


def _check_all_used(
    cfg: ModelConfig, get: TensorGetter, source: str, names: Collection[str], mapped: set[str]
) -> None:
    # Old HF files carry RoPE's derived inv_freq buffers; the model recomputes them.
    unused = sorted(n for n in set(names) - mapped if not n.endswith("rotary_emb.inv_freq"))
    if cfg.tie_embeddings and "lm_head.weight" in unused:
        # Some tied checkpoints store the shared matrix twice; that copy is harmless.
        head, embed = get("lm_head.weight"), get("model.embed_tokens.weight")
        if head is not None and embed is not None and np.array_equal(head, embed):
            unused.remove("lm_head.weight")
        else:
            raise ModelLoadError(
                source,
                "tensor 'lm_head.weight' is in the checkpoint but the config ties the output "
                "layer to the embeddings (tie_embeddings=True); it would be ignored",
            )
    if unused:
        shown = ", ".join(repr(n) for n in unused[:8])
        more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
        raise ModelLoadError(
            source,
            f"checkpoint tensor(s) {shown}{more} are not used by the model config "
            f"(arch={cfg.arch!r}, qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}); "
            "the config does not describe this checkpoint",
        )


def _to_device(value: np.ndarray, var: nnx.Variable, mesh: Mesh | None) -> jax.Array:
    if mesh is None:
        return jax.device_put(value)
    axes = var.get_metadata().get("out_sharding") or (None,) * value.ndim
    sharding = logical_sharding(axes, value.shape, mesh)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


# A merged LoRA delta lost to the cast on more of its entries than this: warned.
LOST_DELTA_WARN = 0.1


def hf_tensors(model: Transformer, *, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The model's parameters as host arrays with HF names and layouts (gathers shards), in
    ``dtype`` (default: each parameter's own). LoRA adapters are merged: W + scale·A·B in
    float32, then cast (HF checkpoints have no place for them, and dropping them would export
    the base). A cast to bf16 rounds away a delta under half a bf16 spacing of W (an RL run's
    often is): when more than LOST_DELTA_WARN of the delta's entries leave W unchanged, a
    warning says so (export with ``dtype="float32"`` to keep them)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    out, moved, lost = {}, 0, 0
    for m in tensor_mappings(model.cfg):
        w = np.asarray(jax.device_get(flat[m.path][...]))
        target = np.dtype(dtype) if dtype else w.dtype
        if m.experts:  # no LoRA on experts (ModelConfig refuses it)
            out.update({n: m.to_hf(w[j].astype(target)) for j, n in enumerate(m.hf_names)})
            continue
        a_path = (*m.path[:-1], m.path[-1].removesuffix("_proj") + "_lora", "a")
        if a_path in flat:
            a = np.asarray(jax.device_get(flat[a_path][...]), np.float32)
            b = np.asarray(jax.device_get(flat[(*a_path[:-1], "b")][...]), np.float32)
            scale = model.cfg.lora_alpha / model.cfg.lora_rank
            base = w.astype(np.float32)
            delta = scale * np.tensordot(a, b, axes=1)
            w = (base + delta).astype(target)
            changed = delta != 0
            moved += int(changed.sum())
            # Lost: the merged entry is the base as this cast rounds it (a float32 base rounded
            # to bf16 loses the delta as surely as a bf16 one).
            lost += int((changed & (w == base.astype(target))).sum())
        out[m.hf_name] = m.to_hf(w.astype(target))
    if moved and lost > LOST_DELTA_WARN * moved:
        log.warning(
            "the exported weights lose the LoRA delta on %.0f%% of its entries (under half a "
            "%s spacing of the base); export in float32 to keep them",
            100 * lost / moved,
            np.dtype(target).name,
        )
    return out


# ---------------------------------------------------------------------------------------------
# HF safetensors directories: config.json + model.safetensors, or shards + an index.


class SafetensorsDir:
    """Read access to the tensors of an HF checkpoint directory (single file or sharded)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(str(index), f"not a valid safetensors index ({e})") from None
            self.file_of = {name: self.dir / file for name, file in weight_map.items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(str(self.dir), "no *.safetensors files found")
            self.file_of = {}
            for file in files:
                with self._open(file) as f:
                    self.file_of.update(dict.fromkeys(f.keys(), file))
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _open(file: Path):  # noqa: ANN205 - safetensors' handle type is private
        if not file.exists():
            raise ModelLoadError(str(file), "file listed in the checkpoint does not exist")
        try:
            return safe_open(str(file), framework="numpy")
        except Exception as e:  # safetensors raises its own (Rust) error types
            raise ModelLoadError(str(file), f"not a valid safetensors file ({e})") from None

    def get(self, name: str) -> np.ndarray | None:
        file = self.file_of.get(name)
        if file is None:
            return None
        if file not in self._handles:
            self._handles[file] = self._open(file).__enter__()
        try:
            return self._handles[file].get_tensor(name)  # type: ignore[attr-defined]
        except Exception as e:
            raise ModelLoadError(str(file), f"cannot read tensor {name!r} ({e})") from None

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)  # type: ignore[attr-defined]
        self._handles.clear()


# safetensors dtype codes -> numpy (the float types checkpoints hold).
_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets of the tensor's data in ``file``
    end: int

    @property
    def row_bytes(self) -> int:  # bytes of one index of the leading dim (row-major)
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class RemoteSafetensors:
    """Read access to the tensors of an HF checkpoint directory on gs:// by ranged reads: the
    index (if any) and each file's header (8-byte length + JSON) when opened, then only the byte
    ranges asked for. ``bytes_read`` counts every byte fetched (headers included)."""

    def __init__(self, directory: str):
        self.dir = directory
        self.bytes_read = 0
        root = storage.path(directory)
        index = root / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(str(index), f"not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f.name for f in root.iterdir() if f.name.endswith(".safetensors"))
            if not files:
                raise ModelLoadError(directory, "no *.safetensors files found")
        self._entries: dict[str, _Entry] = {}
        for name in files:
            self._entries.update(self._header(storage.join(directory, name)))
        if index.exists():
            self.file_of = {n: storage.join(directory, f) for n, f in weight_map.items()}
        else:
            self.file_of = {n: e.file for n, e in self._entries.items()}

    def _read(self, file: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        try:
            out = storage.read_ranges(file, ranges)
        except FileNotFoundError:
            raise ModelLoadError(file, "file listed in the checkpoint does not exist") from None
        for (start, end), got in zip(ranges, out, strict=True):
            if len(got) != end - start:
                raise ModelLoadError(file, f"file ends before byte {end} (truncated?)")
        self.bytes_read += sum(len(b) for b in out)
        return out

    def _header(self, file: str) -> dict[str, _Entry]:
        (raw,) = self._read(file, [(0, 8)])
        size = int.from_bytes(raw, "little")
        if size > _MAX_HEADER_BYTES:
            raise ModelLoadError(file, f"not a valid safetensors file (header of {size} bytes)")
        (raw,) = self._read(file, [(8, 8 + size)])
        try:
            header = json.loads(raw)
            out = {}
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                dtype, shape = _ST_DTYPES[t["dtype"]], tuple(t["shape"])
                begin, end = t["data_offsets"]
                if end - begin != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"tensor {name!r}: data_offsets do not match its shape")
                out[name] = _Entry(file, dtype, shape, 8 + size + begin, 8 + size + end)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(file, f"not a valid safetensors file ({e!r})") from None
        return out

    def _entry(self, name: str) -> _Entry | None:
        file = self.file_of.get(name)
        if file is None:
            return None
        entry = self._entries.get(name)
        if entry is None or entry.file != file:
            raise ModelLoadError(file, f"cannot read tensor {name!r} (not in the file's header)")
        return entry

    def shape(self, name: str) -> tuple[int, ...] | None:
        entry = self._entry(name)
        return None if entry is None else entry.shape

    @property
    def data_bytes(self) -> int:
        """The bytes of all the checkpoint's tensors (what a whole copy would read, headers aside)."""
        return sum(e.end - e.start for e in self._entries.values())

    def get(self, name: str) -> np.ndarray | None:
        """The whole tensor (one ranged read)."""
        entry = self._entry(name)
        if entry is None:
            return None
        (raw,) = self._read(entry.file, [(entry.start, entry.end)])
        return np.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape)

    def rows(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Rows ``[r0, r1)`` of the tensor's leading dim for each range: contiguous bytes in a
        row-major file, so one ranged read each, all in flight at once."""
        entry = self._entry(name)
        assert entry is not None and entry.shape, name
        step = entry.row_bytes
        raw = self._read(
            entry.file, [(entry.start + r0 * step, entry.start + r1 * step) for r0, r1 in ranges]
        )
        return [
            np.frombuffer(b, dtype=entry.dtype).reshape((r1 - r0, *entry.shape[1:]))
            for b, (r0, r1) in zip(raw, ranges, strict=True)
        ]


def _layout(m: TensorMapping, model_shape: tuple[int, ...]) -> bool | None:
    """How ``m.to_model`` lays the HF tensor out, as "reshape(transpose?(x), model_shape)": True
    if it transposes first, False if not, None for a transform not of that form (then the
    tensor is read whole on every host and converted by ``m.to_model`` itself). The mappings of
    hf_format: identity, .T, and for q/k/v/o .T then a head split, for biases a head split
    (tests/models/test_sharded_gcs_load.py checks this against every mapping's to_model)."""
    if math.prod(m.hf_shape) != math.prod(model_shape):
        return None
    if m.to_model is _same:
        return False if model_shape == m.hf_shape else None
    if m.to_model is _transpose:
        return True if model_shape == m.hf_shape[::-1] else None
    if len(m.hf_shape) == 2 and len(model_shape) == 3:
        return True  # [out, in] kernels: transposed, then heads split out
    if len(m.hf_shape) == 1 and len(model_shape) == 2:
        return False  # biases: heads split out
    return None


def _row_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """The leading dim split over as many mesh axes as divide it (every axis when they do), the
    rest whole: each host then reads contiguous rows, about 1/hosts of the tensor."""
    axes: list[str] = []
    n = 1
    for a in mesh.axis_names:
        if mesh.shape[a] > 1 and shape[0] % (n * mesh.shape[a]) == 0:
            axes.append(a)
            n *= mesh.shape[a]
    lead = tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)
    return NamedSharding(mesh, PartitionSpec(lead, *[None] * (len(shape) - 1)))


@functools.lru_cache(maxsize=64)
def _relayout(
    transpose: bool, shape: tuple[int, ...], dtype: np.dtype, out: NamedSharding
) -> Callable[[jax.Array], jax.Array]:
    # Transpose, reshape and cast are exact, so the values are bitwise to_model's on the host.
    def f(x: jax.Array) -> jax.Array:
        return (x.T if transpose else x).reshape(shape).astype(dtype)

    return jax.jit(f, out_shardings=out)


def _place_remote(
    reader: RemoteSafetensors, m: TensorMapping, var: nnx.Variable, mesh: Mesh, dtype: np.dtype
) -> jax.Array:
    shape = tuple(var.shape)
    axes = var.get_metadata().get("out_sharding") or (None,) * len(shape)
    target = logical_sharding(axes, shape, mesh)
    transpose = _layout(m, shape) if m.hf_shape else None
    if transpose is None:  # not a per-row transform: whole tensor on each host, as from disk
        value = np.asarray(m.to_model(reader.get(m.hf_name))).astype(dtype)
        return jax.make_array_from_callback(shape, target, lambda idx: value[idx])
    rows = _row_sharding(mesh, m.hf_shape)

    def span(idx: tuple[slice, ...]) -> tuple[int, int]:
        r0, r1, _ = idx[0].indices(m.hf_shape[0])
        return r0, r1

    # This host's devices' row ranges, each fetched once (replicas on one host share it).
    needed = sorted({span(i) for i in rows.addressable_devices_indices_map(m.hf_shape).values()})
    blocks = dict(zip(needed, reader.rows(m.hf_name, needed), strict=True))
    staged = jax.make_array_from_callback(m.hf_shape, rows, lambda idx: blocks[span(idx)])
    return _relayout(transpose, shape, dtype, target)(staged)


def _build_remote(
    cfg: ModelConfig, reader: RemoteSafetensors, source: str, mesh: Mesh
) -> Transformer:
    """``build_model`` for a gs:// checkpoint over ``mesh``: shapes from the headers, each
    parameter read in row blocks by the hosts and resharded on the devices."""
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = dict(nnx.to_flat_state(state))
    dtype = _NP_DTYPES[cfg.param_dtype]
    mappings = tensor_mappings(cfg)
    mapped = {n for m in mappings for n in m.hf_names}
    _check_all_used(cfg, reader.get, source, reader.file_of.keys(), mapped)
    for m in mappings:
        var = flat[m.path]
        if m.experts:  # each expert's tensor whole on every host, stacked
            value = _host_value(m, reader.get, source).astype(dtype)
            flat[m.path] = var.replace(_to_device(value, var, mesh))
            continue
        _check_shape(source, m, reader.shape(m.hf_name))
        flat[m.path] = var.replace(_place_remote(reader, m, var, mesh, dtype))
    _init_adapters(cfg, flat, mesh)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_hf_config(directory: str | Path, **overrides: object) -> ModelConfig:
    """ModelConfig from ``directory/config.json``; ``overrides`` set our own fields (dtypes ...)."""
    if storage.is_remote(directory):
        path = storage.path(directory) / "config.json"
    else:
        path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(str(path), "file not found") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(str(path), f"not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ModelLoadError(str(path), "not a JSON object")
    return config_from_hf(hf, str(path), **overrides)


def load_safetensors(
    directory: str | Path,
    *,
    mesh: Mesh | None = None,
    cfg: ModelConfig | None = None,
    **overrides: object,
) -> tuple[ModelConfig, Transformer]:
    """Load an HF checkpoint directory (config.json + *.safetensors [+ index]).

    ``cfg`` replaces the directory's config.json; else ``overrides`` adjust it (e.g.
    ``param_dtype="bfloat16"``). With ``mesh``, parameters are created sharded by the rules table.
    A gs:// directory is read in place, with a mesh each host reading about its share (see the
    module's docstring).
    """
    cfg = cfg or read_hf_config(directory, **overrides)
    if storage.is_remote(directory):
        remote = RemoteSafetensors(str(directory))
        if mesh is None:
            model = build_model(cfg, remote.get, str(directory), names=remote.file_of.keys())
        else:
            model = _build_remote(cfg, remote, str(directory), mesh)
        log.info(
            "read %d bytes of %s (its tensors: %d bytes)",
            remote.bytes_read,
            directory,
            remote.data_bytes,
        )
        return cfg, model
    reader = SafetensorsDir(directory)
    try:
        model = build_model(cfg, reader.get, str(directory), mesh, names=reader.file_of.keys())
    finally:
        reader.close()
    return cfg, model


def save_safetensors(
    model: Transformer,
    directory: str | Path,
    *,
    max_shard_bytes: int = 2 * 2**30,
    dtype: str | None = None,
) -> list[Path]:
    """Write ``model`` as an HF checkpoint (config.json + safetensors, sharded with an index
    when larger than ``max_shard_bytes``), in ``dtype`` (``hf_tensors``). Returns the
    safetensors files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, dtype=dtype)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    hf_config = config_to_hf(model.cfg) | ({"dtype": dtype} if dtype else {})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    meta = {"format": "pt"}  # transformers refuses files without it
    if len(shards) == 1:
        files = [out / "model.safetensors"]
        save_file(shards[0], str(files[0]), metadata=meta)
        return files
    width = max(5, int(math.log10(len(shards))) + 1)
    files = [
        out / f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors"
        for i in range(len(shards))
    ]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(file), metadata=meta)
        weight_map.update(dict.fromkeys(shard, file.name))
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files
