"""load_model / load_tokenizer: from a run's ModelConfig to weights (init, safetensors, GGUF)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu.config import MeshConfig
from rlax_tpu.models.checkpoint import save_safetensors
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.loader import checkpoint_config, load_model, load_tokenizer
from rlax_tpu.models.presets import preset
from rlax_tpu.models.sharding import make_mesh
from rlax_tpu.models.tokenizer import Tokenizer
from rlax_tpu.models.transformer import forward


def _values(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_seeded_init_is_the_same_sharded_or_not():
    cfg = preset("tiny", seed=7)
    sharded = load_model(cfg, mesh=make_mesh(MeshConfig(fsdp=4, tensor=2)))
    assert sharded.layers[0].mlp.gate_proj[...].sharding.spec == jax.sharding.PartitionSpec(
        "fsdp", "tensor"
    )
    for a, b in zip(_values(sharded), _values(load_model(cfg)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_safetensors_checkpoint_must_match_the_config(tmp_path):
    original = load_model(preset("tiny", seed=1))
    save_safetensors(original, tmp_path)
    cfg = preset("tiny", weights_format="safetensors", weights_path=str(tmp_path))
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(
        np.asarray(forward(load_model(cfg), tokens)), np.asarray(forward(original, tokens))
    )
    wrong = dataclasses.replace(cfg, num_layers=2, rope_theta=500.0)
    with pytest.raises(ModelLoadError) as info:
        load_model(wrong)
    assert str(info.value) == (
        f"{tmp_path}: the checkpoint does not match model config: "
        "num_layers: config 2, checkpoint 4; rope_theta: config 500.0, checkpoint 10000.0"
    )
    assert checkpoint_config(wrong).num_layers == 4


def test_smollm2_preset_loads_from_gguf_in_bf16(smollm2_path):
    cfg = preset(
        "smollm2-135m",
        weights_format="gguf",
        weights_path=str(smollm2_path),
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
    )
    model = load_model(cfg)
    assert model.embed[...].dtype == jnp.bfloat16
    tok = load_tokenizer(cfg)
    assert tok.encode("Hello world!") == [19556, 905, 17]


def test_tokenizer_sources(tmp_path):
    trained = Tokenizer.train_bpe(["some text for a tiny vocabulary"] * 10, vocab_size=300)
    trained.save(tmp_path)
    cfg = preset("tiny", tokenizer_path=str(tmp_path))
    assert load_tokenizer(cfg).encode("some text") == trained.encode("some text")
    with pytest.raises(ModelLoadError, match="^model.tokenizer_path: a randomly initialized model"):
        load_tokenizer(preset("tiny"))


def test_weights_and_tokenizer_from_gs(gcs_emulator, tmp_path, monkeypatch):
    """model.weights_path and model.tokenizer_path on gs:// (a GCS server on 127.0.0.1): the
    safetensors folder is read in place (ranged reads, nothing copied into RLAX_CACHE_DIR) and
    loads as from disk; the tokenizer is read in place."""
    import uuid

    from rlax_tpu import storage

    from ..conftest import GCS_BUCKET

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    base = f"gs://{GCS_BUCKET}/weights-{uuid.uuid4().hex[:8]}"
    original = load_model(preset("tiny", seed=2))
    save_safetensors(original, tmp_path / "local")
    for f in (tmp_path / "local").iterdir():  # the shards and config.json
        storage.write_atomic(f"{base}/model/{f.name}", f.read_bytes())
    trained = Tokenizer.train_bpe(["words for a tiny vocabulary"] * 10, vocab_size=300)
    trained.save(f"{base}/tok")
    cfg = preset(
        "tiny",
        weights_format="safetensors",
        weights_path=f"{base}/model",
        tokenizer_path=f"{base}/tok",
    )
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(
        np.asarray(forward(load_model(cfg), tokens)), np.asarray(forward(original, tokens))
    )
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
    assert load_tokenizer(cfg).encode("tiny words") == trained.encode("tiny words")
    missing = dataclasses.replace(cfg, weights_path=f"{base}/nothing")
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(missing)


def test_a_gs_gguf_is_refused_in_a_multi_process_job_before_any_download(tmp_path, monkeypatch):
    """[pod-fidelity]: GGUF is memory-mapped from a local copy, so on gs:// every process of a
    multi-host job would download all of it (safetensors are read in place, each host its
    share). A model built in code in such a job is refused before a byte is fetched (RunConfig
    refuses the config: tests/config/test_validation.py)."""
    from rlax_tpu import storage

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    fetched = []
    monkeypatch.setattr(storage, "local_copy", lambda p: fetched.append(p))
    cfg = preset("tiny", weights_format="gguf", weights_path="gs://bucket/model.gguf")
    with pytest.raises(ModelLoadError, match="copied whole to each of 2 processes"):
        load_model(cfg)
    assert fetched == []
