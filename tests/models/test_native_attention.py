"""The native CPU decode attention (a C++ XLA FFI kernel built here with g++) against dense
attention, the XLA cache write, and itself in other rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.models import DenseKVCache, native_attention
from rlax_tpu.models.paged_attention import reference_attention
from rlax_tpu.models.paged_cache import PagedKVCache
from rlax_tpu.models.scoring import native_kernel

H, HKV, D = 6, 2, 16
CFG = ModelConfig(
    arch="llama",
    vocab_size=32,
    hidden_size=H * D,
    intermediate_size=32,
    num_layers=2,
    num_heads=H,
    num_kv_heads=HKV,
    max_position_embeddings=128,
)


def _caches(page_size: int, rows: int, pages: int, seed: int):
    """A native and an XLA paged cache over the same shuffled tables, and a dense cache."""
    rng = np.random.default_rng(seed)
    num_pages = 1 + rows * pages
    tables = jnp.asarray(1 + rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    make = lambda native: PagedKVCache.create(  # noqa: E731
        CFG,
        num_pages=num_pages,
        page_size=page_size,
        batch=rows,
        pages_per_seq=pages,
        native=native,
    ).with_tables(tables)
    dense = DenseKVCache.create(
        num_layers=2,
        batch=rows,
        max_len=pages * page_size,
        kv_heads=HKV,
        head_dim=D,
        dtype=jnp.float32,
    )
    return make(True), make(False), dense, rng


@pytest.mark.parametrize(
    ("page_size", "lengths"), [(1, [1, 5, 9]), (4, [3, 16, 23, 8]), (16, [40, 2])]
)
def test_native_decode_is_dense_attention_and_writes_the_xla_paths_pages(page_size, lengths):
    """Token by token through a layer: outputs within f32 round-off of the dense cache's (its
    own summation order and exp polynomial: observed <= 5e-7, asserted 2e-6); the pages hold
    bitwise what XLA's scatter writes (copies). Rows that have finished are padding (zeros)."""
    rows, pages = len(lengths), -(-max(lengths) // page_size)
    native, xla, dense, rng = _caches(page_size, rows, pages, seed=page_size)
    step = jax.jit(lambda c, *a: c.attend(1, *a))
    for t in range(max(lengths)):
        pos = np.array([t if t < n else -1 for n in lengths], np.int32)[:, None]
        q = jnp.asarray(rng.standard_normal((rows, 1, H, D)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((rows, 1, HKV, D)), jnp.float32) for _ in range(2))
        got, native = step(native, q, k, v, jnp.asarray(pos))
        _, xla = step(xla, q, k, v, jnp.asarray(pos))
        want, dense = dense.attend(1, q, k, v, jnp.asarray(pos))
        live = pos[:, 0] >= 0
        np.testing.assert_allclose(
            np.asarray(got)[live], np.asarray(want)[live], atol=2e-6, rtol=1e-5
        )
        assert not np.asarray(got)[~live].any()
    np.testing.assert_array_equal(np.asarray(native.k_pages), np.asarray(xla.k_pages))
    np.testing.assert_array_equal(np.asarray(native.v_pages), np.asarray(xla.v_pages))
    assert not np.asarray(native.k_pages[0]).any()  # only the layer asked for was written


def test_a_native_row_does_not_depend_on_the_other_rows_or_its_index():
    """The same row alone, beside longer rows, and moved to another batch index gives the same
    bits (what keeps the engine's log-probs bitwise its replay's)."""
    rng = np.random.default_rng(3)
    b, pages, page = 4, 6, 4
    k_pages, v_pages = (
        jnp.asarray(rng.standard_normal((2, HKV, 1 + b * pages, page, D)), jnp.float32)
        for _ in range(2)
    )
    tables = np.asarray(1 + np.arange(b * pages).reshape(b, pages), np.int32)
    q = rng.standard_normal((b, H, D)).astype(np.float32)
    kn, vn = (jnp.zeros((b, HKV, D), jnp.float32) for _ in range(2))
    run = jax.jit(
        lambda q, t, p: native_attention.decode_attention(
            q, kn, vn, k_pages, v_pages, t, p, layer=0
        )[0]
    )

    def row0(order, positions):
        perm = np.asarray(order)
        return np.asarray(
            run(
                jnp.asarray(q[perm]),
                jnp.asarray(tables[perm]),
                jnp.asarray(np.asarray(positions, np.int32)),
            )
        )

    alone = row0([0, 1, 2, 3], [9, -1, -1, -1])[0]
    for order, positions, at in (
        ([0, 1, 2, 3], [9, 23, 17, 0], 0),
        ([3, 2, 1, 0], [0, 17, 23, 9], 3),
    ):
        np.testing.assert_array_equal(row0(order, positions)[at], alone)
    got = row0([0, 1, 2, 3], [9, 23, 17, 0])
    p = np.asarray([9, 23, 17, 0])
    phys, slot = tables[np.arange(b), p // page], p % page  # where the zero keys/values went
    k_ref, v_ref = (x[0].at[:, phys, slot].set(0.0) for x in (k_pages, v_pages))
    ref = reference_attention(
        jnp.asarray(q)[:, None], k_ref, v_ref, jnp.asarray(tables), jnp.asarray(p[:, None])
    )
    np.testing.assert_allclose(got, np.asarray(ref)[:, 0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("dim", "group"), [(16, 1), (32, 2), (64, 3), (128, 8), (256, 4)])
def test_every_head_dim_and_group_is_the_reference_across_16_key_blocks(dim, group):
    """Each instantiated head dim / query group, at positions before, on and across the
    16-key blocks the keys' pass takes at once on AVX-512 hosts (pages of 3 keys, so a block
    spans pages): within f32 round-off of the reference (observed <= 8.4e-7, asserted 2e-6)."""
    rng = np.random.default_rng(dim + group)
    hkv, page, rows = 2, 3, 6
    h, pages = hkv * group, 14  # 42 positions
    k_pages, v_pages = (
        jnp.asarray(rng.standard_normal((1, hkv, 1 + rows * pages, page, dim)), jnp.float32)
        for _ in range(2)
    )
    tables = jnp.asarray(1 + rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    positions = jnp.asarray([0, 14, 15, 16, 33, 41], jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, h, dim)), jnp.float32)
    kn, vn = (jnp.asarray(rng.standard_normal((rows, hkv, dim)), jnp.float32) for _ in range(2))
    got, k_out, v_out = jax.jit(lambda *a: native_attention.decode_attention(*a, layer=0))(
        q, kn, vn, k_pages, v_pages, tables, positions
    )
    ref = reference_attention(q[:, None], k_out[0], v_out[0], tables, positions[:, None])
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref)[:, 0], atol=2e-6, rtol=1e-5)


def test_bad_tables_and_shapes_are_errors_not_reads_out_of_bounds():
    rows, pages = 2, 3
    k_pages = jnp.zeros((1, HKV, 1 + rows * pages, 4, D), jnp.float32)
    q = jnp.zeros((rows, H, D), jnp.float32)
    kn = jnp.zeros((rows, HKV, D), jnp.float32)
    positions = jnp.asarray([0, 1], jnp.int32)
    bad = jnp.asarray([[1, 2, 99], [4, 5, 6]], jnp.int32)
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(
            native_attention.decode_attention(
                q, kn, kn, k_pages, k_pages + 0, bad, positions, layer=0
            )
        )
    odd = jnp.zeros((1, HKV, 1 + rows * pages, 4, 24), jnp.float32)
    with pytest.raises(Exception, match="unsupported head dim"):
        jax.block_until_ready(
            native_attention.decode_attention(
                jnp.zeros((rows, H, 24)),
                jnp.zeros((rows, HKV, 24)),
                jnp.zeros((rows, HKV, 24)),
                odd,
                odd + 0,
                bad % 7,
                positions,
                layer=0,
            )
        )


def test_the_build_is_cached_per_cpu_and_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAX_TPU_NATIVE_DIR", str(tmp_path))
    first = native_attention.build()
    assert first.parent == tmp_path and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert native_attention.build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    monkeypatch.setenv("CXX", "no-such-compiler-rlax")
    with pytest.raises(native_attention.NativeUnavailable, match="attention_kernel = 'xla'"):
        native_attention.build()


def test_the_config_chooses_the_kernel():
    assert native_kernel(InferenceConfig(attention_kernel="native"), CFG)
    assert not native_kernel(InferenceConfig(attention_kernel="xla"), CFG)
    wide = ModelConfig(
        arch="llama",
        vocab_size=32,
        hidden_size=96,
        intermediate_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
    )
    assert not native_kernel(InferenceConfig(), wide)  # auto: not built for head dim 24
    with pytest.raises(ValueError, match="head dims"):
        native_kernel(InferenceConfig(attention_kernel="native"), wide)
    with pytest.raises(ValueError, match="attention_kernel"):
        InferenceConfig(attention_kernel="fast")


def test_a_hung_build_is_unavailable_not_an_error(tmp_path, monkeypatch):
    """A compiler that never finishes: the build gives up after its timeout, NativeUnavailable
    says so, and 'auto' would fall back to XLA."""
    hung = tmp_path / "hung-cxx"
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    monkeypatch.setenv("RLAX_TPU_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(hung))
    monkeypatch.setattr(native_attention, "BUILD_TIMEOUT_S", 1.0)
    with pytest.raises(native_attention.NativeUnavailable, match="took over 1.0 s"):
        native_attention.build()
    assert not list((tmp_path / "cache").iterdir())  # no half-built library left


def test_native_on_a_mesh_of_several_devices_is_refused():
    from rlax_tpu import models
    from rlax_tpu.config import MeshConfig
    from rlax_tpu.inference.engine import Engine

    model = models.init_model(models.preset("tiny", num_layers=1), seed=0)
    cfg = InferenceConfig(
        attention_kernel="native", mesh=MeshConfig(data=1, fsdp=1, tensor=2), kv_cache_bytes=2**22
    )
    with pytest.raises(ValueError, match="'native' runs on one device; .* spans 2"):
        Engine(model, cfg, devices=jax.devices()[:2])
