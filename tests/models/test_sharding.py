"""Logical-axis sharding on 8 CPU devices: parameters sharded over (fsdp=4, tensor=2) give the
unsharded forward's logits; the rules table decides every parameter's PartitionSpec."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlax_tpu.config import MeshConfig
from rlax_tpu.models.checkpoint import load_safetensors, save_safetensors
from rlax_tpu.models.presets import preset
from rlax_tpu.models.sharding import logical_to_spec, make_mesh, param_shardings, shard_model
from rlax_tpu.models.transformer import forward, init_model

CFG = preset("tiny", tie_embeddings=False, qkv_bias=True)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py forces 8 CPU devices"
    return make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))


def _jit_forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: forward(nnx.merge(graphdef, s), t)), state


def test_sharded_forward_matches_unsharded(mesh):
    model = init_model(CFG, seed=2)
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, CFG.vocab_size, jnp.int32)
    f, state = _jit_forward(model)
    reference = np.asarray(f(state, tokens))

    shard_model(model, mesh)
    q = model.layers[0].attn.q_proj[...]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (128 // 4, 4 // 2, 32)  # 1/8 of it per device
    f, state = _jit_forward(model)
    with jax.set_mesh(mesh):
        logits = f(state, tokens)
    assert len(logits.sharding.device_set) == 8
    assert np.abs(np.asarray(logits) - reference).max() <= 1e-5


def test_every_parameter_follows_the_rules_table(mesh):
    shardings = param_shardings(nnx.state(init_model(CFG)), mesh)
    specs = {
        "/".join(map(str, path)): v.get_value().spec for path, v in nnx.to_flat_state(shardings)
    }
    assert specs["embed"] == P("tensor", "fsdp")  # [vocab, embed]
    assert specs["lm_head"] == P("fsdp", "tensor")  # [embed, vocab]
    assert specs["layers/0/attn/o_proj"] == P("tensor", None, "fsdp")  # [heads, head_dim, embed]
    assert specs["layers/0/attn/k_bias"] == P("tensor", None)  # [kv_heads, head_dim]
    assert specs["layers/0/mlp/down_proj"] == P("tensor", "fsdp")  # [mlp, embed]
    assert specs["layers/0/input_norm/weight"] == P(None)


def test_indivisible_dimensions_are_replicated(mesh):
    # SmolLM2 has 3 KV heads: not divisible by tensor=2, so that dimension stays whole.
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (576, 3, 64), mesh) == P(
        "fsdp", None, None
    )
    assert logical_to_spec(("embed", "heads", "head_dim"), (576, 9, 64), mesh) == P(
        "fsdp", None, None
    )
    assert logical_to_spec(("batch", "length"), (8, 5), mesh) == P("fsdp", None)  # data=1 dropped
    with pytest.raises(KeyError, match="'bogus' has no rule"):
        logical_to_spec(("bogus",))


def test_checkpoint_loads_directly_into_sharded_arrays(mesh, tmp_path):
    model = init_model(CFG, seed=3)
    save_safetensors(model, tmp_path)
    _, sharded = load_safetensors(tmp_path, mesh=mesh)
    up = sharded.layers[1].mlp.up_proj[...]
    assert up.sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(np.asarray(up), np.asarray(model.layers[1].mlp.up_proj[...]))


def test_a_mesh_over_slices_keeps_fsdp_and_tensor_inside_each_slice():
    """mesh.slices = 2 over one process's 8 devices (emulated: in order, 4 per slice): each
    slice's devices form the (1, 2, 2) mesh of one data row; the whole mesh is (2, 2, 2)."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2, slices=2), jax.devices())
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    ids = [sorted(d.id for d in row.flat) for row in mesh.devices]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="3 slices"):
        make_mesh(MeshConfig(data=1, fsdp=1, tensor=2, slices=3), jax.devices()[:5])


def test_a_tpu_multislice_mesh_groups_devices_by_their_slice_index():
    """Compile-only devices of 2 x v5p:2x2x1 (libtpu's topology with num_slices) carry the
    runtime's slice_index: each data row of the mesh is one slice's 4 chips."""
    from rlax_tpu.aot.report import topology_devices

    devices = topology_devices("v5p:2x2x1", slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1, slices=2), devices[::-1])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
