"""Paged attention == dense causal attention, for every backend, page size and ragged lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.config import ModelConfig
from rlax_tpu.inference.pages import BlockTable, PageAllocator
from rlax_tpu.models import DenseKVCache
from rlax_tpu.models.paged_attention import (
    block_attention,
    reference_attention,
    resolve_backend,
    span_attention,
)
from rlax_tpu.models.paged_cache import PagedKVCache

H, HKV, D = 4, 2, 16
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


def _chunks(lengths: list[int], chunk: int):
    """Position chunks [B, chunk] walking each sequence to its length (-1 = padding)."""
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        pos = np.full((len(lengths), chunk), -1, np.int32)
        for b, n in enumerate(lengths):
            take = min(chunk, n - done[b])
            pos[b, :take] = np.arange(done[b], done[b] + take)
            done[b] += take
        yield pos


def _run(
    backend: str,
    page_size: int,
    lengths: list[int],
    chunk: int,
    seed: int = 0,
    block_pages: int = 0,
):
    """Feeds random q/k/v through a paged and a dense cache; returns both outputs per chunk."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    pages_per_seq = -(-max(lengths) // page_size) + 1  # one spare: tail of the null page
    s = pages_per_seq * page_size
    alloc = PageAllocator(1 + b * pages_per_seq + 3)
    alloc.allocate(3)  # so that sequences do not start at page 1
    tables = [BlockTable(page_size) for _ in lengths]
    for t, n in zip(tables, lengths, strict=True):
        t.prepare_write(alloc, 0, n, [])
    rows = np.stack([t.row(pages_per_seq) for t in tables])
    paged = PagedKVCache.create(
        CFG,
        num_pages=alloc.num_pages,
        page_size=page_size,
        batch=b,
        pages_per_seq=pages_per_seq,
        backend=backend,
        block_pages=block_pages,
    ).with_tables(jnp.asarray(rows))
    dense = DenseKVCache.create(
        num_layers=2, batch=b, max_len=s, kv_heads=HKV, head_dim=D, dtype=jnp.float32
    )
    outs = []
    for pos in _chunks(lengths, chunk):
        q = jnp.asarray(rng.standard_normal((b, chunk, H, D)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, chunk, HKV, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((b, chunk, HKV, D)), jnp.float32)
        got, paged = paged.attend(1, q, k, v, jnp.asarray(pos))
        # TPU interpret mode runs the kernel through host callbacks that dispatch jax ops; let it
        # finish before dispatching more (concurrent dispatch can deadlock the CPU client).
        got, paged = jax.block_until_ready((got, paged))
        want, dense = dense.attend(1, q, k, v, jnp.asarray(pos))
        outs.append((pos, np.asarray(got), np.asarray(want)))
    return outs


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunk", [1, 5])
def test_cpu_paged_attention_is_bitwise_dense(page_size, chunk):
    # Bitwise by construction: both caches run eagerly, op by op, and hand the same primitives
    # ([B, S, Hkv, D] keys/values of equal bits, the same mask) to dot_product_attention.
    for pos, got, want in _run("cpu", page_size, [1, 7, 16, 23], chunk):
        valid = pos >= 0
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got[valid], want[valid])


@pytest.mark.parametrize("page_size, rows, pages", [(4, 8, 12), (16, 64, 20)])
def test_span_attention_is_the_whole_cache_attention_up_to_round_off(page_size, rows, pages):
    """Row groups attending over their own pages (inference.span_groups) give the whole-cache
    output to f32 round-off (the dropped keys are masked there; XLA:CPU sums a shorter axis in
    another order: observed <= 5e-7 on O(1) outputs, asserted 2e-6)."""
    rng = np.random.default_rng(page_size)
    num_pages = rows * pages + 1
    k_pages, v_pages = (
        jnp.asarray(rng.standard_normal((HKV, num_pages, page_size, D)), jnp.float32)
        for _ in range(2)
    )
    q = jnp.asarray(rng.standard_normal((rows, 1, H, D)), jnp.float32)
    positions = np.sort(rng.integers(0, pages * page_size, rows)).astype(np.int32)
    positions[:2] = -1  # padding rows come first
    tables = np.zeros((rows, pages), np.int32)
    free = iter(rng.permutation(np.arange(1, num_pages)))
    for b, p in enumerate(positions):
        for m in range(p // page_size + 1 if p >= 0 else 0):
            tables[b, m] = next(free)
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions)[:, None])
    want = np.asarray(jax.jit(reference_attention)(*args))
    half = rows // 2
    need = [
        max(1, int(positions[s].max()) // page_size + 1)
        for s in (slice(0, half), slice(half, rows))
    ]
    spans = ((half, need[0]), (rows - half, need[1]))
    assert need[0] < pages  # the short group really drops pages
    got = np.asarray(jax.jit(lambda *a: span_attention(*a, spans))(*args))
    valid = positions >= 0
    np.testing.assert_allclose(got[valid], want[valid], rtol=0, atol=2e-6)
    # Every group over all pages: the same math, but another program (rows split in two), so
    # equal to round-off, not asserted bitwise (XLA:CPU may tile the halves differently).
    full = ((half, pages), (rows - half, pages))
    same = np.asarray(jax.jit(lambda *a: span_attention(*a, full))(*args))
    np.testing.assert_allclose(same[valid], want[valid], rtol=0, atol=2e-6)


# The GPU kernel pre-scales q and has its own reduction order; the TPU kernel's stand-in sums in
# f32 in another order than the dense path: f32 round-off only.
TOLERANCE = {"gpu_interpret": 1e-5, "tpu_emulated": 1e-5}


@pytest.mark.parametrize("backend", ["tpu_emulated", "gpu_interpret"])
@pytest.mark.parametrize("page_size", [4, 8])
def test_pallas_paged_attention_matches_dense(backend, page_size):
    """Through the cache: writes into the backend's layout (combined pages for tpu_emulated),
    packing of ragged rows (chunks of 3 with padding), attention."""
    tol = TOLERANCE[backend]
    for pos, got, want in _run(backend, page_size, [1, 9, 20], chunk=3, seed=1):
        valid = pos >= 0
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[valid], want[valid], rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(4))
def test_emulated_ragged_kernel_keeps_the_kernels_contract(seed):
    """The CPU stand-in for the TPU ragged kernel equals JAX's own reference implementation of
    that kernel (``ref_ragged_paged_attention``) on random ragged batches: mixed prefill and
    decode lengths, fewer live sequences than slots, GQA. f32 round-off (observed ~3e-7)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    from rlax_tpu.models.paged_attention import emulated_ragged_kernel

    rng = np.random.default_rng(seed)
    num_pages, page, hkv, h, d, slots, m = 40, 4, 2, 8, 128, 6, 4
    kv = jnp.asarray(rng.standard_normal((num_pages, page, 2 * hkv, d)), jnp.float32)
    live = int(rng.integers(1, slots + 1))
    kv_lens = np.zeros(slots, np.int32)
    q_lens = np.zeros(slots, np.int32)
    kv_lens[:live] = rng.integers(1, m * page + 1, live)
    q_lens[:live] = [rng.integers(1, k + 1) if rng.random() < 0.5 else 1 for k in kv_lens[:live]]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1]) + 3  # room past the last sequence
    q = jnp.asarray(rng.standard_normal((tokens, h, d)), jnp.float32)
    tables = jnp.asarray(rng.integers(1, num_pages, (slots, m)), jnp.int32)
    args = (q, kv, jnp.asarray(kv_lens), tables, jnp.asarray(cu), jnp.asarray([live], jnp.int32))
    want = np.asarray(ref_ragged_paged_attention(*args, sm_scale=d**-0.5))
    got = np.asarray(jax.jit(lambda *a: emulated_ragged_kernel(*a, sm_scale=d**-0.5))(*args))
    np.testing.assert_allclose(got[: cu[live]], want, rtol=0, atol=2e-6)
    assert not got[cu[live] :].any()


def test_auto_backend_is_cpu_here():
    assert resolve_backend("auto") == "cpu"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("npu")


def test_tpu_kernel_under_a_mesh_runs_per_shard_and_matches_unsharded():
    """Mosaic kernels are not partitioned by XLA: under a mesh the TPU backend runs the kernel
    in shard_map (rows over fsdp, heads over tensor), each device packing its own rows. Checked
    with the kernel's stand-in: the sharded call equals the single-device one and the dense
    reference to f32 round-off."""
    from rlax_tpu.config import MeshConfig
    from rlax_tpu.models import make_mesh
    from rlax_tpu.models.paged_attention import ragged_attention

    rng = np.random.default_rng(3)
    rows, chunk, page_size, pages, num_pages = 8, 3, 4, 3, 32
    kv_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, 2 * HKV, 128)), jnp.float32)
    kv_pages = kv_pages.at[..., D:].set(0.0)  # lane padding
    q = jnp.asarray(rng.standard_normal((rows, chunk, H, D)), jnp.float32)
    tables = jnp.asarray(
        rng.permutation(np.arange(1, num_pages))[: rows * pages].reshape(rows, pages), jnp.int32
    )
    starts = rng.integers(0, pages * page_size - chunk, rows)
    lengths = rng.integers(0, chunk + 1, rows)  # some rows empty, some partly padded
    positions = np.full((rows, chunk), -1, np.int32)
    for b in range(rows):
        positions[b, : lengths[b]] = np.arange(starts[b], starts[b] + lengths[b])
    args = (q, kv_pages, tables, jnp.asarray(positions))
    call = jax.jit(lambda *a: ragged_attention(*a, kv_heads=HKV, emulated=True))
    single = np.asarray(call(*args))
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2), jax.devices()[:8])
    with jax.set_mesh(mesh):
        sharded = np.asarray(
            jax.jit(lambda *a: ragged_attention(*a, kv_heads=HKV, emulated=True))(*args)
        )
    np.testing.assert_allclose(sharded, single, rtol=0, atol=1e-6)
    k_pages = kv_pages[..., 0::2, :D].transpose(2, 0, 1, 3)  # the split layout [Hkv, P, page, D]
    v_pages = kv_pages[..., 1::2, :D].transpose(2, 0, 1, 3)
    want = np.asarray(reference_attention(q, k_pages, v_pages, tables, jnp.asarray(positions)))
    valid = positions >= 0
    np.testing.assert_allclose(sharded[valid], want[valid], rtol=0, atol=1e-5)
    assert not sharded[~valid].any()


@pytest.mark.parametrize(("page_size", "block_pages"), [(1, 3), (4, 1), (16, 3)])
def test_block_attention_is_dense_attention_up_to_round_off(page_size, block_pages):
    """Decode rows through the cache with attention_block_pages: the dense cache's attention to
    f32 round-off (an online softmax sums in another order); prefill chunks (T > 1) keep the
    whole-cache path, bitwise."""
    for pos, got, want in _run("cpu", page_size, [1, 7, 16, 23], 1, block_pages=block_pages):
        valid = pos >= 0
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[valid], want[valid], atol=2e-6, rtol=1e-5)
    for pos, got, want in _run("cpu", page_size, [7, 23], 5, block_pages=block_pages):
        np.testing.assert_array_equal(got[pos >= 0], want[pos >= 0])


def test_a_block_attention_row_does_not_depend_on_the_other_rows():
    """The trip count follows the step's furthest row; a row's bits must not: the same row alone,
    beside a long row, and beside only padding gives the same bits (what keeps the engine's
    log-probs bitwise its replay's). Padding rows give zeros."""
    rng = np.random.default_rng(1)
    b, pages, page = 4, 12, 4
    k_pages, v_pages = (
        jnp.asarray(rng.standard_normal((HKV, 1 + b * pages, page, D)), jnp.float32)
        for _ in range(2)
    )
    tables = jnp.asarray(1 + np.arange(b * pages).reshape(b, pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, 1, H, D)), jnp.float32)
    run = jax.jit(block_attention, static_argnames="block_pages")
    outs = [
        np.asarray(
            run(q, k_pages, v_pages, tables, jnp.asarray(p, jnp.int32)[:, None], block_pages=2)
        )
        for p in ([5, -1, -1, -1], [5, 47, 30, -1], [5, 9, -1, 2])
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out[0], outs[0][0])
    assert not outs[0][1:].any() and not outs[1][3].any()
    ref = reference_attention(q, k_pages, v_pages, tables, jnp.asarray([[5], [47], [30], [0]]))
    np.testing.assert_allclose(outs[1][:3], np.asarray(ref)[:3], atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="T = 1"):
        block_attention(
            jnp.zeros((b, 2, H, D)),
            k_pages,
            v_pages,
            tables,
            jnp.zeros((b, 2), jnp.int32),
            block_pages=2,
        )
