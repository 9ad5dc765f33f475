"""What XLA:TPU counts for ``jax.lax.ragged_dot`` (the MoE experts' grouped matmul), compiled for
v5p through libtpu: the forward counts every row, whatever the groups hold, and the weight
gradient counts every group dense. benchmarks/RESULTS.md ("Mixture of experts") reads the v5p_moe
trainer's FLOPs by it; when a JAX release changes either, this test says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from rlax_tpu.aot.report import topology_devices

M, K, N = 512, 256, 128  # rows, model width, expert width


def _flops(fn, groups: int) -> float:  # noqa: ANN001
    device = topology_devices("v5p:2x2x1")[0]
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=SingleDeviceSharding(device)
    )
    compiled = (
        jax.jit(fn).lower(spec((M, K)), spec((groups, K, N)), spec((groups,), jnp.int32)).compile()
    )
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def _weight_grad(x, w, sizes):  # noqa: ANN001, ANN202
    return jax.grad(lambda w: jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32).sum())(w)


@pytest.mark.parametrize("groups", [8, 32])
def test_ragged_dot_counts_every_row_and_its_weight_gradient_every_group(groups):
    textbook = 2 * M * K * N  # each row through the one group it belongs to
    assert _flops(jax.lax.ragged_dot, groups) == pytest.approx(textbook, rel=0.01)
    assert _flops(_weight_grad, groups) == pytest.approx(groups * textbook, rel=0.05)
