"""What XLA:TPU counts for the MoE experts' grouped matmuls, compiled for v5p through libtpu.
``jax.lax.ragged_dot``: the forward counts every row, whatever the groups hold, and the weight
gradient counts every group dense. The megablox kernels (``model.expert_kernel`` "auto" on TPU):
their declared cost, every row once forward and once in each gradient (their grids visit only
the groups' row tiles at run time, which no static count shows). benchmarks/RESULTS.md
("Mixture of experts") reads the v5p_moe trainer's FLOPs by these; when a JAX release changes
one, this test says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from rlax_tpu.aot.report import topology_devices
from rlax_tpu.models.grouped_matmul import grouped_matmul

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


def _weight_grad(x, w, sizes, kernel="ragged_dot"):  # noqa: ANN001, ANN202
    loss = lambda w: grouped_matmul(x, w, sizes, kernel).astype(jnp.float32).sum()  # noqa: E731
    return jax.grad(loss)(w)


def _megablox(x, w, sizes):  # noqa: ANN001, ANN202
    return grouped_matmul(x, w, sizes, "megablox")


@pytest.mark.parametrize("groups", [8, 32])
def test_ragged_dot_counts_every_row_and_its_weight_gradient_every_group(groups):
    textbook = 2 * M * K * N  # each row through the one group it belongs to
    assert _flops(jax.lax.ragged_dot, groups) == pytest.approx(textbook, rel=0.01)
    assert _flops(_weight_grad, groups) == pytest.approx(groups * textbook, rel=0.05)


@pytest.mark.parametrize("groups", [8, 32])
def test_megablox_counts_its_weight_gradient_once(groups):
    textbook = 2 * M * K * N
    assert _flops(_megablox, groups) == pytest.approx(textbook, rel=0.01)
    # tgmm alone (the forward's product is unused and eliminated): one M·K·N, not G of them.
    weight_grad = _flops(lambda x, w, s: _weight_grad(x, w, s, "megablox"), groups)
    assert weight_grad == pytest.approx(textbook, rel=0.01)
