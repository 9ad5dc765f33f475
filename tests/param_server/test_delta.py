"""Deltas between versions (param_server/delta.py): the rebuilt version is bitwise the new one,
each array takes the smallest encoding, and a wrong base or damaged delta is caught."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from rlax_tpu.param_server.delta import apply, apply_tree, encode, encode_tree
from rlax_tpu.param_server.errors import DataLoss, InvalidArgument

from .conftest import random_bits


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _changed(base: np.ndarray, where: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``base`` with the flat elements ``where`` given other bit patterns."""
    new = base.copy()
    flat = new.reshape(-1).view(np.dtype(f"u{new.dtype.itemsize}"))
    flat[where] ^= rng.integers(1, 2**15, len(where)).astype(flat.dtype)
    return new


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("case", "kind"),
    [("none", "same"), ("few", "entries"), ("one run", "chunks"), ("most", "full")],
)
def test_the_rebuilt_array_is_bitwise_the_new_one(dtype, case, kind):
    rng = np.random.default_rng(3)
    base = random_bits(rng, (256, 96), dtype)  # NaN payloads, -0, infinities, subnormals
    n = base.size
    where = {
        "none": np.array([], np.int64),
        "few": rng.choice(n, 20, replace=False),
        "one run": np.arange(5000, 9000),  # dense in one place: whole chunks
        "most": rng.choice(n, int(0.9 * n), replace=False),
    }[case]
    new = _changed(base, where, rng)
    delta = encode(base, new)
    assert delta.kind == kind
    assert _bits_equal(apply(base, delta), new)
    width = np.dtype(dtype).itemsize
    assert delta.nbytes <= n * width
    if kind == "entries":  # index + value per changed element
        assert delta.nbytes == len(where) * (4 + width)


def test_sign_of_zero_and_nan_payloads_count_as_changes():
    base = np.ones(100, np.float32)
    base[:2] = [0.0, np.nan]
    new = base.copy()
    new[0] = -0.0
    new.view(np.uint32)[1] ^= 1  # another NaN
    delta = encode(base, new)
    assert delta.kind == "entries" and delta.indices.tolist() == [0, 1]
    assert _bits_equal(apply(base, delta), new)


def test_a_short_last_chunk():
    base = np.zeros(1000 + 7, ml_dtypes.bfloat16)  # 4096-byte chunks of 2048 elements: one short
    new = base.copy()
    new[-500:] = 1
    delta = encode(base, new, chunk_bytes=256)
    assert delta.kind == "chunks"
    assert _bits_equal(apply(base, delta), new)


def test_a_tree_rebuilds_against_its_base_only():
    rng = np.random.default_rng(5)
    base = [random_bits(rng, (64, 16), "bfloat16"), random_bits(rng, (16,), "float32")]
    new = [_changed(base[0], np.array([3, 700]), rng), base[1].copy()]
    delta = encode_tree(base, new, base_version=7)
    assert delta.kinds() == {"same": 1, "entries": 1, "chunks": 0, "full": 0}
    assert delta.nbytes == 2 * (4 + 2)
    rebuilt = apply_tree(base, delta)
    assert all(_bits_equal(a, b) for a, b in zip(rebuilt, new, strict=True))
    other = [_changed(base[0], np.array([9]), rng), base[1]]  # not the base it was made against
    with pytest.raises(DataLoss, match="against version 7 fails its checksum"):
        apply_tree(other, delta)
    damaged = dataclasses.replace(delta.deltas[0], values=delta.deltas[0].values[::-1].copy())
    with pytest.raises(DataLoss):
        apply_tree(base, dataclasses.replace(delta, deltas=(damaged, delta.deltas[1])))


def test_mismatched_shapes_are_refused():
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(InvalidArgument, match="shape and dtype"):
        encode(a, np.zeros((4, 5), np.float32))
    with pytest.raises(InvalidArgument, match="applied to a base"):
        apply(np.zeros(3, np.float32), encode(a, a + 1))
    with pytest.raises(InvalidArgument, match="arrays"):
        encode_tree([a], [a, a], base_version=0)
