"""The project's GGUF header reader against the ``gguf`` package's reader (the independent
reference): every field's value and every tensor's bytes, shape and type, on the real SmolLM2
file and on one written with every value type and a non-default alignment."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.gguf_file import GGUFFile


def assert_same_as_reference(path) -> GGUFFile:  # noqa: ANN001
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, value in fields.items():
        assert ours.field(key) == value and type(ours.field(key)) is type(value), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(t.shape.tolist())
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        np.testing.assert_array_equal(mine.data, t.data)
    return ours


def test_the_smollm2_file_reads_as_the_gguf_package_reads_it(smollm2_path):
    ours = assert_same_as_reference(smollm2_path)
    assert len(ours.field("tokenizer.ggml.tokens")) == 49152
    kinds = {t.tensor_type for t in ours.tensors.values()}
    assert gguf.GGMLQuantizationType.Q4_1 in kinds and gguf.GGMLQuantizationType.F32 in kinds


def test_every_value_type_and_a_custom_alignment(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ünï"])
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("c", np.arange(4, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = assert_same_as_reference(path)
    assert ours.field("t.str") == "héllo" and ours.field("t.strs") == ["a", "", "ünï"]
    np.testing.assert_array_equal(ours.tensor("c"), np.arange(4, dtype=np.float32))


def test_an_unsupported_version_is_named(tmp_path, smollm2_path):
    bad = tmp_path / "v9.gguf"
    data = bytearray(smollm2_path.read_bytes()[:4096])
    data[4:8] = (9).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"not a valid GGUF file .*version 9"):
        GGUFFile(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        GGUFFile(empty)
