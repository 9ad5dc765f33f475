"""SequencePagedCache: whole right-padded sequences through each engine backend's paged
attention give the dense full-sequence forward's logits, on one device and under a mesh (the TPU
layout's pages split over the batch axes with their rows), scanned or unrolled.

Tolerance: the backends sum attention in another order than the dense reference (online
softmax over pages in the TPU stand-in, a gathered view on CPU), so logits (|x| ~ 1) agree to
2e-5 absolute on real tokens; padding columns are unspecified and not compared.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_tpu import models
from rlax_tpu.config import MeshConfig
from rlax_tpu.models.paged_cache import SequencePagedCache
from rlax_tpu.trainer.mesh import build_mesh


def _rows(b: int = 4, t: int = 21, seed: int = 0):
    r = np.random.default_rng(seed)
    lengths = r.integers(3, t + 1, b)
    lengths[0] = t
    cols = np.arange(t)[None, :]
    positions = np.where(cols < lengths[:, None], cols, -1).astype(np.int32)
    tokens = np.where(positions >= 0, r.integers(0, 512, (b, t)), 0).astype(np.int32)
    return tokens, positions, positions >= 0


def _logits(model, tokens, positions, cache, loop=models.UNROLLED):  # noqa: ANN001, ANN202
    @jax.jit
    def run(tokens, positions):  # noqa: ANN001, ANN202
        hidden, _ = model(tokens, positions, cache, loop)
        return model.logits(hidden)

    return np.asarray(run(tokens, positions))


@pytest.mark.parametrize(("backend", "page"), [("cpu", 4), ("cpu", 16), ("tpu_emulated", 8)])
def test_equals_dense_forward(backend, page):
    cfg = models.preset("tiny", num_layers=2, num_kv_heads=2)
    model = models.init_model(cfg, seed=1)
    tokens, positions, real = _rows()
    want = _logits(model, tokens, positions, models.NoCache())
    got = _logits(model, tokens, positions, SequencePagedCache(page, backend))
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=2e-5)
    scanned = _logits(
        model, tokens, positions, SequencePagedCache(page, backend), models.LayerLoop(scan=True)
    )
    np.testing.assert_allclose(scanned[real], want[real], rtol=0, atol=2e-5)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 4, 2), (8, 1, 1)])
def test_tpu_layout_under_a_mesh(mesh_shape):
    cfg = models.preset("tiny", num_layers=2, num_heads=4, num_kv_heads=2)
    mesh = build_mesh(MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]))
    model = models.init_model(cfg, seed=2, mesh=mesh)
    tokens, positions, real = _rows(b=8, t=19, seed=3)
    want = _logits(model, tokens, positions, models.NoCache())
    with jax.set_mesh(mesh):
        got = _logits(
            model,
            tokens,
            positions,
            SequencePagedCache(8, "tpu_emulated"),
            models.LayerLoop(scan=True),
        )
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=2e-5)
