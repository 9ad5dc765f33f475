"""One call from a run's ``ModelConfig`` to a model and a tokenizer (trainer and inference use
the same, so they run the same weights)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
from jax.sharding import Mesh

from rlax_tpu import storage
from rlax_tpu.config import ModelConfig
from rlax_tpu.models.checkpoint import load_safetensors, read_hf_config
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.gguf_file import GGUFFile
from rlax_tpu.models.gguf_io import config_from_gguf, load_gguf
from rlax_tpu.models.tokenizer import Tokenizer
from rlax_tpu.models.transformer import Transformer, init_model

# Fields the run config chooses; every other field must agree with the checkpoint.
_RUN_FIELDS = (
    "param_dtype",
    "compute_dtype",
    "weights_format",
    "weights_path",
    "tokenizer_path",
    "seed",
    # A run's adapters, never a base checkpoint's (they start fresh on top of it).
    "lora_rank",
    "lora_alpha",
    "lora_targets",
)


def checkpoint_config(cfg: ModelConfig) -> ModelConfig:
    """The architecture the checkpoint at ``cfg.weights_path`` describes, with ``cfg``'s run fields
    (dtypes, paths, seed). Useful to write a config for a checkpoint."""
    run = {f: getattr(cfg, f) for f in _RUN_FIELDS}
    if cfg.weights_format == "safetensors":
        return read_hf_config(cfg.weights_path, **run)
    if cfg.weights_format == "gguf":
        return config_from_gguf(GGUFFile(cfg.weights_path), **run)
    return cfg


def load_model(cfg: ModelConfig, *, mesh: Mesh | None = None) -> Transformer:
    """Random init (``weights_format='init'``, seeded) or the checkpoint at ``weights_path``,
    sharded over ``mesh`` if given.

    Raises ModelLoadError if the checkpoint's architecture differs from ``cfg`` (the run config
    is the single description of the model; ``checkpoint_config`` shows what the file holds).
    """
    if cfg.weights_format == "init":
        return init_model(cfg, mesh=mesh)
    run = {f: getattr(cfg, f) for f in _RUN_FIELDS}
    if cfg.weights_format == "safetensors":
        # gs:// safetensors are read in place, each host only about its share of the tensors
        # (ranged reads, checkpoint.RemoteSafetensors): no host downloads the whole checkpoint.
        where = cfg.weights_path
        if storage.is_remote(where) and not storage.path(where).exists():
            raise ModelLoadError(where, "no such file or folder")
        _check_same_architecture(cfg, read_hf_config(where, **run))
        return load_safetensors(where, mesh=mesh, cfg=cfg)[1]
    # gs:// GGUF is copied to the local cache once (GGUFFile maps a local file): on one host
    # only (RunConfig refuses it for several; this is for models built in code).
    if storage.is_remote(cfg.weights_path) and jax.process_count() > 1:
        raise ModelLoadError(
            cfg.weights_path,
            f"a GGUF file on gs:// would be copied whole to each of {jax.process_count()} "
            "processes; convert it to HF safetensors (read in place, each host its share)",
        )
    file = GGUFFile(_local(cfg.weights_path))  # parsed once
    _check_same_architecture(cfg, config_from_gguf(file, **run))
    return load_gguf(file, mesh=mesh, **run)[1]


def _resolved(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(
        cfg,
        head_dim=cfg.resolved_head_dim,
        rope_original_max_position_embeddings=cfg.resolved_rope_original_max_position_embeddings,
    )


def _check_same_architecture(cfg: ModelConfig, found: ModelConfig) -> None:
    diffs = []
    ours, theirs = _resolved(cfg), _resolved(found)
    for f in dataclasses.fields(cfg):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        same = math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) else a == b
        if f.name not in _RUN_FIELDS and not same:
            diffs.append(f"{f.name}: config {a!r}, checkpoint {b!r}")
    if diffs:
        raise ModelLoadError(
            cfg.weights_path, "the checkpoint does not match model config: " + "; ".join(diffs)
        )


def load_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """``tokenizer_path`` (tokenizer.json, its directory, or a .gguf) if set, else the tokenizer
    that comes with the weights."""
    path = cfg.tokenizer_path or (cfg.weights_path if cfg.weights_format != "init" else "")
    if not path:
        raise ModelLoadError(
            "model.tokenizer_path",
            "a randomly initialized model has no tokenizer: set model.tokenizer_path "
            "(e.g. one saved by Tokenizer.train_bpe(...).save(dir))",
        )
    if Path(path).suffix == ".gguf":
        return Tokenizer.from_gguf(_local(path))
    return Tokenizer.from_file(path)


def _local(path: str) -> str:
    """A local copy of a gs:// file or folder (``storage.local_copy``); local paths as given."""
    if not storage.is_remote(path):
        return path
    try:
        return str(storage.local_copy(path))
    except FileNotFoundError:
        raise ModelLoadError(path, "no such file or folder") from None
