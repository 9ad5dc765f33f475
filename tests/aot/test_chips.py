"""Chip specs, the compiler's HBM limit and the sizes XLA prints."""

from __future__ import annotations

import pytest

from rlax_tpu.aot.chips import CHIPS, GiB, chip_of, device_spec, hbm_limit_from_error, parse_size
from rlax_tpu.aot.report import TopologyError, topology_devices


def test_parse_size_reads_xla_binary_units():
    assert parse_size("15.75G") == int(15.75 * GiB)
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("3") == 3
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_hbm_limit_is_read_from_both_oom_messages():
    a = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (400.00G) exceeds available HBM (15.75G)."
    )
    b = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Used 20.5G of 95.74G hbm."
    assert hbm_limit_from_error(a) == int(15.75 * GiB)
    assert hbm_limit_from_error(b) == int(95.74 * GiB)
    assert hbm_limit_from_error("INVALID_ARGUMENT: shapes differ") is None


def test_unknown_chip_is_named():
    assert chip_of("v5p:4x8x8") is CHIPS["v5p"]
    with pytest.raises(KeyError, match="known: v4, v5e, v5p, v6e"):
        chip_of("v9x:2x2")


@pytest.mark.parametrize(
    "topology, per_chip, table_gib",
    [("v5e:2x2", 1, 16), ("v5p:2x2x1", 1, 95), ("v4:2x2x1", 2, 16), ("v6e:2x2", 1, 32)],
)
def test_device_spec_probes_the_compilers_hbm_limit(topology, per_chip, table_gib):
    """libtpu's v4 topology runs each TensorCore as a device (half a chip each); the usable HBM
    the compiler names is within 5% of the published HBM per device (some is reserved; v5p names
    95.74 GiB against the published 95)."""
    devices = topology_devices(topology)
    spec = device_spec(topology, devices[0])
    assert spec.devices_per_chip == per_chip
    assert spec.usable_hbm_source == "compiler"
    assert spec.hbm_bytes == table_gib * GiB
    assert 0.95 * spec.hbm_bytes <= spec.usable_hbm_bytes <= spec.hbm_bytes * 1.01
    assert spec.roofline_s(spec.bf16_flops, 0.0) == pytest.approx(1.0)
    assert spec.roofline_s(0.0, spec.hbm_bandwidth * 2) == pytest.approx(2.0)


def test_aot_refuses_a_slice_cloud_tpu_does_not_offer_before_compiling():
    """v5p's 256 chips are 4x8x8 (config/slices.py); libtpu would compile 8x8x4 too."""
    with pytest.raises(TopologyError, match="write it v5p:4x8x8"):
        topology_devices("v5p:8x8x4")


def test_a_mesh_axis_must_be_a_product_of_the_slices_physical_axes():
    """JAX lays a mesh over a TPU slice by giving each mesh axis whole torus axes
    (jax/_src/mesh_utils.py, _create_device_mesh_for_nd_torus: "The size of each axis in your
    logical mesh must be equal to the product of some subset of the physical mesh axis sizes"):
    the v5p preset's tensor 8 fits its 4x8x8 slice but not a 4x4x4 one, where tensor 4 does.
    The refusal is a config error naming the axes, before anything compiles."""
    from rlax_tpu.config import ConfigError, MeshConfig
    from rlax_tpu.models.sharding import make_mesh

    devices = topology_devices("v5p:4x4x4")
    with pytest.raises(ConfigError, match=r"\(1, 8, 1, 8\) does not map onto .* axes 4x4x4"):
        make_mesh(MeshConfig(data=1, fsdp=-1, tensor=8), devices)
    assert make_mesh(MeshConfig(data=1, fsdp=-1, tensor=4), devices).shape["fsdp"] == 16
    assert make_mesh(MeshConfig(data=1, fsdp=-1, tensor=8), topology_devices("v5p:4x8x8"))


@pytest.mark.parametrize("topology", ["v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8", "v6e:4x8"])
def test_the_renderers_torus_rule_is_jaxs(topology):
    """config/slices.lays_out (what the GKE render checks without a TPU) accepts exactly the
    (data, fsdp, tensor) shapes jax.make_mesh lays over the compile-only slice (v5e is not
    checked: JAX splits its torus axes, so every shape lays out)."""
    from rlax_tpu.config import ConfigError, MeshConfig
    from rlax_tpu.config.slices import lays_out, parse_slice
    from rlax_tpu.models.sharding import make_mesh

    devices, dims = topology_devices(topology), parse_slice(topology).dims
    seen = set()
    for data in (1, 2, 4, 8):
        for tensor in (1, 2, 4, 8, 16, 32):
            if len(devices) % (data * tensor):
                continue
            shape = (data, len(devices) // (data * tensor), tensor)
            try:
                make_mesh(MeshConfig(data=data, fsdp=shape[1], tensor=tensor), devices)
                jax_lays_it = True
            except ConfigError:
                jax_lays_it = False
            assert lays_out(shape, dims) == jax_lays_it, shape
            seen.add(jax_lays_it)
    assert seen == {True, False}  # both answers occur on each slice
