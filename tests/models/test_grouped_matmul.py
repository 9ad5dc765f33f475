"""The experts' grouped matmul: megablox's Pallas kernels (in Pallas's interpreter, as they run
here) against ``jax.lax.ragged_dot``, values and both gradients, with empty groups, rows past the
groups and row counts that are no multiple of the row tile; and which kernel ``auto`` picks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rlax_tpu.aot.report import topology_devices
from rlax_tpu.config import ConfigError, ModelConfig
from rlax_tpu.models.grouped_matmul import grouped_matmul, resolve_kernel

# (rows, contracted, out, group sizes, dtype, tolerance relative to the largest value): f32 to
# round-off; bf16 to its 8-bit mantissa (the kernels round the output and gradients to bf16).
CASES = {
    "f32-empty-group-and-tail": (200, 64, 96, [50, 0, 70, 60], jnp.float32, 1e-5),
    "bf16-wider-than-a-tile": (300, 192, 640, [10, 100, 0, 150], jnp.bfloat16, 2e-2),
    "f32-groups-fill-every-row": (256, 32, 48, [128, 64, 64], jnp.float32, 1e-5),
    # 768 (Qwen3-30B-A3B's expert width) in tiles of 384.
    "f32-768-wide": (64, 768, 768, [20, 30], jnp.float32, 1e-5),
}


def _loss(rows, weights, sizes, cotangent, kernel):  # noqa: ANN001, ANN202
    # The cotangent reaches the rows past the groups too: no gradient may come of it.
    out = grouped_matmul(rows, weights, sizes, kernel).astype(jnp.float32)
    if kernel == "ragged_dot":  # whose output there is unspecified
        out = jnp.where(jnp.arange(rows.shape[0])[:, None] < jnp.sum(sizes), out, 0)
    return jnp.sum(out * cotangent)


@pytest.mark.parametrize("case", list(CASES))
def test_megablox_equals_ragged_dot_values_and_gradients(case):
    m, k, n, sizes, dtype, tol = CASES[case]
    sizes = jnp.asarray(sizes, jnp.int32)
    total = int(sizes.sum())
    keys = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(keys[0], (m, k), dtype)
    weights = jax.random.normal(keys[1], (len(sizes), k, n), dtype)
    cotangent = jax.random.normal(keys[2], (m, n), jnp.float32)
    got = grouped_matmul(rows, weights, sizes, "megablox_interpret")
    want = jax.lax.ragged_dot(rows, weights, sizes)
    assert got.dtype == want.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got[:total], want[:total], atol=tol * np.abs(want).max(), rtol=0)
    assert not got[total:].any()  # zeros past the groups (the interpreter leaves NaN there)
    grads = {
        kernel: jax.jit(jax.grad(_loss, (0, 1)), static_argnums=4)(
            rows, weights, sizes, cotangent, kernel
        )
        for kernel in ("megablox_interpret", "ragged_dot")
    }
    for got, want in zip(grads["megablox_interpret"], grads["ragged_dot"], strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)
    assert not np.asarray(grads["megablox_interpret"][0], np.float32)[total:].any()


def test_auto_is_megablox_for_tpu_devices_and_ragged_dot_here():
    assert resolve_kernel("auto") == "ragged_dot"  # this host's CPU
    mesh = Mesh(np.asarray(topology_devices("v5p:2x2x1")), ("expert",))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert resolve_kernel("auto") == "megablox"
    assert resolve_kernel("megablox_interpret") == "megablox_interpret"
    with pytest.raises(ValueError, match="unknown expert kernel 'pallas'"):
        resolve_kernel("pallas")
    with pytest.raises(ConfigError, match="expert_kernel"):
        ModelConfig(expert_kernel="pallas")
