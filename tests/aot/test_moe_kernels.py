"""The MoE layer with the TPU expert kernels compiles for a TPU mesh without an expert axis (an
inference worker's: tensor 4), through libtpu. XLA cannot partition a Pallas (Mosaic) call
("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a shard_map", jax
0.10.2): the v5p_moe worker's decode failed so before the layer took its shard_map on every mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tpu import models
from rlax_tpu.aot.report import topology_devices
from rlax_tpu.config import MeshConfig
from rlax_tpu.models.aot import abstract
from rlax_tpu.models.sharding import make_mesh


def test_the_moe_layer_with_megablox_compiles_on_a_tensor_mesh():
    cfg = models.preset(
        "tiny",
        arch="qwen3_moe",
        qk_norm=True,
        num_layers=1,
        num_experts=8,
        experts_per_token=2,
        expert_intermediate_size=256,
        compute_dtype="bfloat16",
    )
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=4), topology_devices("v5p:2x2x1"))
    graphdef, state = nnx.split(models.abstract_model(cfg))
    state = abstract(state, models.param_shardings(state, mesh))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32, sharding=NamedSharding(mesh, P()))

    def logits(state, tokens):  # noqa: ANN001, ANN202
        return models.forward(nnx.merge(graphdef, state), tokens)

    with jax.set_mesh(mesh):
        compiled = jax.jit(logits).lower(state, tokens).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the megablox kernels, not ragged_dot's expansion
    assert np.prod(mesh.devices.shape) == 4
