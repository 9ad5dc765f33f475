"""One train step on 8-device meshes equals the single-device step.

Tolerance: sharding changes the order of f32 reductions (matmuls split over fsdp/tensor, psums),
so results agree to rounding, not bitwise: loss to 1e-6 absolute (|loss| ~ 0.05), gradient norm
to 1e-5 relative, updated params to 1e-6 absolute (0.1% of the step's update: Adam moves each
coordinate by ~lr = 1e-3 on the first step). These tests use adam_eps = 1e-5: Adam divides by
|g| + eps, so with the default 1e-8 a gradient coordinate that is ~0 turns its rounding
difference (~1e-9) into an update difference of up to lr * 1e-9 / 1e-8 = 1e-4.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_tpu.trainer import Trainer

from .helpers import host, random_batch, run_config

MESHES = [(8, 1, 1), (2, 4, 1), (1, 4, 2)]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    trainer = Trainer(
        run_config((1, 1, 1), adam_eps=1e-5),
        devices=jax.devices()[:1],
        checkpoint_dir=tmp_path_factory.mktemp("single"),
    )
    before = host(trainer.params())
    metrics = trainer.train_step(random_batch(0))
    after = host(trainer.params())
    trainer.close()
    return before, metrics, after


@pytest.mark.parametrize("mesh", [*MESHES, (1, 2, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_step_on_mesh_equals_single_device(mesh, single_device, tmp_path):
    """(1, 2, 2, 2): two emulated slices (mesh.slices; 4 devices each) of (1, 2, 2): a
    (2, 2, 2) mesh whose data axis crosses the slices."""
    before, ref_metrics, ref_after = single_device
    slices = mesh[3] if len(mesh) > 3 else 1
    trainer = Trainer(run_config(mesh[:3], adam_eps=1e-5, slices=slices), checkpoint_dir=tmp_path)
    mesh = (mesh[0] * slices, *mesh[1:3])
    data, fsdp, tensor = mesh
    assert dict(trainer.mesh.shape) == {"data": data, "fsdp": fsdp, "expert": 1, "tensor": tensor}
    # Params really are sharded as the rules say (embed [vocab, embed] -> tensor, fsdp).
    embed = trainer.params()["embed"]
    assert embed.sharding.spec == jax.sharding.PartitionSpec(
        "tensor" if mesh[2] > 1 else None, "fsdp" if mesh[1] > 1 else None
    )
    jax.tree.map(np.testing.assert_array_equal, host(trainer.params()), before)
    metrics = trainer.train_step(random_batch(0))
    trainer.close()
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    after = host(trainer.params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), after, ref_after)
    # The update moved the params by far more than the tolerance.
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), ref_after, before)))
    assert moved > 5e-4
