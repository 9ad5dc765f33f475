"""The TPU slice table (rlax_tpu/config/slices.py) against the Cloud TPU docs' own tables, and
config validation with it (the AOT command's refusal: tests/aot/test_chips.py)."""

from __future__ import annotations

import pytest

from rlax_tpu.config import ConfigError, TopologyConfig
from rlax_tpu.config.slices import parse_slice

# https://cloud.google.com/tpu/docs/v5p, "Topology | Cores | Chips | Hosts ..." (read 2026-11),
# e.g. "4x8x8 512 256 64 4 ct5p-hightpu-4t Yes": every row, as (topology, chips, hosts).
V5P_TABLE = [
    ("2x2x1", 4, 1),
    ("2x2x2", 8, 2),
    ("2x4x4", 32, 8),
    ("4x4x4", 64, 16),
    ("4x4x8", 128, 32),
    ("4x8x8", 256, 64),
    ("8x8x8", 512, 128),
    ("8x8x16", 1024, 256),
    ("8x16x16", 2048, 512),
    ("16x16x16", 4096, 1024),
    ("16x16x24", 6144, 1536),
]
# https://cloud.google.com/tpu/docs/v5e "1x1 1 1/8, 2x2 4 1/2, 2x4 8 1, 4x4 16 2, 4x8 32 4,
# 8x8 64 8, 8x16 128 16, 16x16 256 32" and https://cloud.google.com/tpu/docs/v6e (the same
# shapes): up to 2x4 one VM; beyond, GKE's multi-host node pools are 4-chip VMs
# (ct5lp-hightpu-4t, ct6e-standard-4t), so the VM count is chips / 4.
PLANAR_TABLE = ["1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"]


@pytest.mark.parametrize(("topology", "chips", "hosts"), V5P_TABLE)
def test_every_documented_v5p_slice_is_offered_with_its_hosts(topology, chips, hosts):
    s = parse_slice(f"v5p:{topology}")
    assert (s.chips, s.hosts, s.chips_per_host) == (chips, hosts, 4)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("topology", PLANAR_TABLE)
def test_every_documented_v5e_and_v6e_slice_is_offered(generation, topology):
    s = parse_slice(f"{generation}:{topology}")
    a, b = map(int, topology.split("x"))
    assert s.chips == a * b
    assert s.hosts == (1 if s.chips <= 8 else s.chips // 4)


def test_dimensions_are_written_in_ascending_order():
    """types-topologies: "The representation of a v4 topology is AxBxC where A<=B<=C"; the v5p
    table writes its 256 chips as 4x8x8, and GKE's gke-tpu-topology labels use these strings,
    so 8x8x4 would select no node pool (the trainer's 64 pods stay Pending)."""
    with pytest.raises(
        ValueError, match=r"Cloud TPU offers no v5p:8x8x4 slice: write it v5p:4x8x8"
    ):
        parse_slice("v5p:8x8x4")
    with pytest.raises(ValueError, match=r"write it v5e:2x4"):
        parse_slice("v5e:4x2")
    with pytest.raises(ValueError, match=r"write it v4:2x2x4"):
        parse_slice("v4:4x2x2")


@pytest.mark.parametrize("name", ["v5p:2x2x3", "v5p:4x4x6", "v5p:2x4x8", "v6e:3x5", "v5e:2x8"])
def test_shapes_no_table_has_are_refused(name):
    """v4/v5p dimensions are all <= 4 (1, 2, 4: within a cube) or all multiples of 4
    (types-topologies); v5e/v6e have their eight shapes."""
    with pytest.raises(ValueError, match=f"Cloud TPU offers no {name} slice"):
        parse_slice(name)


def test_the_config_refuses_a_slice_no_node_pool_carries():
    with pytest.raises(
        ConfigError, match=r"topology.trainer_tpu = 'v5p:8x8x4'.*write it v5p:4x8x8"
    ):
        try:
            TopologyConfig(trainer_tpu="v5p:8x8x4")
        except ConfigError as e:
            raise e.prefixed("topology") from None
    assert TopologyConfig(trainer_tpu="v5p:4x8x8", inference_tpu="v5e:2x4").trainer_tpu
