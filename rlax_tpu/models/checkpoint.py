"""Build a model from named HF-layout tensors, and the HF safetensors reader / writer.

Tensors go straight from host memory into (possibly sharded) device arrays: with a mesh, each
device receives only its slice (``jax.make_array_from_callback``); no full replica is made on
any device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from rlax_tpu.config import ModelConfig
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.hf_format import config_from_hf, config_to_hf, tensor_mappings
from rlax_tpu.models.sharding import logical_sharding
from rlax_tpu.models.transformer import Transformer

# (hf_name) -> host array in HF layout, or None if the checkpoint lacks it.
TensorGetter = Callable[[str], np.ndarray | None]

_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


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
        _check_all_used(cfg, get, source, names, {m.hf_name for m in mappings})
    for m in mappings:
        host = get(m.hf_name)
        if host is None:
            raise ModelLoadError(source, f"tensor {m.hf_name!r} is missing from the checkpoint")
        if tuple(host.shape) != m.hf_shape:
            raise ModelLoadError(
                source,
                f"tensor {m.hf_name!r} has shape {tuple(host.shape)}, the config expects {m.hf_shape}",
            )
        var = flat[m.path]
        value = np.asarray(m.to_model(host)).astype(dtype)
        flat[m.path] = var.replace(_to_device(value, var, mesh))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


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


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters as host arrays with HF names and layouts (gathers shards)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    return {
        m.hf_name: m.to_hf(np.asarray(jax.device_get(flat[m.path][...])))
        for m in tensor_mappings(model.cfg)
    }


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


def read_hf_config(directory: str | Path, **overrides: object) -> ModelConfig:
    """ModelConfig from ``directory/config.json``; ``overrides`` set our own fields (dtypes ...)."""
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
    """
    cfg = cfg or read_hf_config(directory, **overrides)
    reader = SafetensorsDir(directory)
    try:
        model = build_model(cfg, reader.get, str(directory), mesh, names=reader.file_of.keys())
    finally:
        reader.close()
    return cfg, model


def save_safetensors(
    model: Transformer, directory: str | Path, *, max_shard_bytes: int = 2 * 2**30
) -> list[Path]:
    """Write ``model`` as an HF checkpoint (config.json + safetensors, sharded with an index
    when larger than ``max_shard_bytes``). Returns the safetensors files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    (out / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2))
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
