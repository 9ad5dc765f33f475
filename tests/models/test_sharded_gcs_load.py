"""A safetensors checkpoint on gs:// (the GCS emulator) loads in place, each host reading only
about its share: bitwise the same parameters and shardings as from local disk, in one process
over 8 devices and in two jax.distributed processes whose fsdp axis spans both, each of which
reads half of the tensors' bytes (counted by the emulator, per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import storage
from rlax_tpu.config import MeshConfig, ModelConfig
from rlax_tpu.models.checkpoint import (
    RemoteSafetensors,
    _layout,
    abstract_model,
    save_safetensors,
)
from rlax_tpu.models.hf_format import tensor_mappings
from rlax_tpu.models.loader import load_model
from rlax_tpu.models.presets import preset
from rlax_tpu.models.sharding import make_mesh
from tests.child_env import child_env

from ..conftest import GCS_BUCKET, free_port

WORKER = Path(__file__).with_name("sharded_load_worker.py")


def model_config(weights: str = "", **overrides: object) -> ModelConfig:
    """The tiny preset as qwen3 with every kind of tensor layout (untied lm_head, q/k/v biases,
    q/k norms): ~0.9 M f32 parameters, 3.7 MB, its header 1/400 of that. Random init without
    ``weights``."""
    return preset(
        "tiny",
        arch="qwen3",
        tie_embeddings=False,
        qkv_bias=True,
        qk_norm=True,
        weights_format="safetensors" if weights else "init",
        weights_path=weights,
        **overrides,
    )


def test_every_mapping_is_a_transpose_and_reshape():
    """_layout's reading of hf_format's transforms (which per-host loading applies on device)
    is what each to_model does."""
    cfg = model_config()
    flat = dict(nnx.to_flat_state(nnx.state(abstract_model(cfg))))
    rng = np.random.default_rng(0)
    for m in tensor_mappings(cfg):
        shape = tuple(flat[m.path].shape)
        transpose = _layout(m, shape)
        assert transpose is not None, m.hf_name
        x = rng.standard_normal(m.hf_shape).astype(np.float32)
        np.testing.assert_array_equal((x.T if transpose else x).reshape(shape), m.to_model(x))


@pytest.fixture(scope="module")
def checkpoint(gcs_emulator, tmp_path_factory):
    """(local folder, the same on gs://, its safetensors file's size) of a seeded tiny model."""
    local = tmp_path_factory.mktemp("weights")
    save_safetensors(load_model(model_config(seed=3)), local)
    remote = f"gs://{GCS_BUCKET}/sharded-load-{uuid.uuid4().hex[:8]}"
    for f in local.iterdir():
        storage.write_atomic(f"{remote}/{f.name}", f.read_bytes())
    return local, remote


def _served(emulator: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{emulator}/_rlax/bytes_served", timeout=10) as r:
        return json.loads(r.read())


def _sizes(local: Path) -> tuple[int, int, int]:
    """(the tensors' bytes, the file's header bytes, config.json's bytes)."""
    raw = (local / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    return len(raw) - header, header, (local / "config.json").stat().st_size


def _leaves(model) -> list[jax.Array]:  # noqa: ANN001
    return jax.tree.leaves(nnx.state(model))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_one_process_reads_the_file_once_and_loads_as_from_disk(
    checkpoint, gcs_emulator, monkeypatch, param_dtype
):
    """Over (1, 4, 2) on this process's 8 devices: the same values (bitwise, also through the
    f32 -> bf16 cast) and shardings as the local load, with every byte of the file read once."""
    import fsspec.config

    local, remote = checkpoint
    reader = f"single-{param_dtype}"
    # A new gcsfs client whose requests the emulator counts under `reader`.
    monkeypatch.setitem(
        fsspec.config.conf, "gs", {"session_kwargs": {"headers": {"X-Rlax-Reader": reader}}}
    )
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    got = load_model(model_config(remote, param_dtype=param_dtype), mesh=mesh)
    want = load_model(model_config(str(local), param_dtype=param_dtype), mesh=mesh)
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    data, header, _ = _sizes(local)
    # The file once (config.json is read through epath's own gcsfs client, not counted here).
    assert _served(gcs_emulator)[reader] == data + header
    assert RemoteSafetensors(remote).data_bytes == data


def test_two_processes_each_read_half(checkpoint, gcs_emulator, tmp_path):
    """Two processes of 4 devices on (1, 4, 2), fsdp across both: each reads exactly half of
    the tensors' bytes plus the header and config.json (every tensor's leading dim divides by
    8, so no tensor is read by both; there is no slack to allow), and the parameters are
    bitwise the local load's."""
    local, remote = checkpoint
    coordinator = f"127.0.0.1:{free_port()}"
    base = child_env()
    readers = [f"proc-{uuid.uuid4().hex[:6]}-{pid}" for pid in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(pid), remote, str(tmp_path)],
            env=base
            | {"FSSPEC_GS": json.dumps({"session_kwargs": {"headers": {"X-Rlax-Reader": r}}})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid, r in enumerate(readers)
    ]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            p.kill()
    data, header, config = _sizes(local)
    served = _served(gcs_emulator)
    assert [served[r] for r in readers] == [data // 2 + header + config] * 2, (served, data)
    want = _leaves(
        load_model(model_config(str(local)), mesh=make_mesh(MeshConfig(fsdp=4, tensor=2)))
    )
    got = np.load(tmp_path / "params.npz")
    assert len(got.files) == len(want)
    for i, b in enumerate(want):
        a = got[f"arr_{i}"]
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, np.asarray(b))
