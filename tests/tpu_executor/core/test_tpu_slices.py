"""The TPU slice table: a slice's name maps to its chips, topology, hosts and HBM."""
import pytest

from tpu_executor.core.tpu_slices import GIB, Target


@pytest.mark.parametrize("name, chips, topology, per_host, hosts", [
    ("v5e-1", 1, "v5e:1x1", (1, 1, 1), 1),
    ("v5e-8", 8, "v5e:2x4", (2, 4, 1), 1),
    ("v5e-16", 16, "v5e:4x4", (2, 2, 1), 4),
    ("v6e-4", 4, "v6e:2x2", (2, 2, 1), 1),
    ("v6e-256", 256, "v6e:16x16", (2, 2, 1), 64),
    ("v5p-8", 4, "v5p:2x2x1", (2, 2, 1), 1),
    ("v4-16", 8, "v4:2x2x2", (2, 2, 1), 2),
    ("tpu7x-8", 4, "tpu7x:2x2x1", (2, 2, 1), 1),
    ("tpu7x-32", 16, "tpu7x:2x2x4", (2, 2, 1), 4),
])
def test_a_slice_name_gives_its_layout(name, chips, topology, per_host, hosts):
    target = Target.parse(name)
    assert (target.num_chips, target.topology_name, target.chips_per_host_bounds, target.num_hosts) == \
        (chips, topology, per_host, hosts)
    assert target.name == name


def test_a_v7x_chip_is_two_devices_with_half_its_memory_each():
    """Ironwood's TensorCores are devices of their own: the mesh of tpu7x-8 (4 chips) holds 8."""
    target = Target.parse("tpu7x-8")
    assert (target.num_chips, target.num_devices, target.device_kind) == (4, 8, "TPU7x")
    assert target.chip.hbm_bytes == int(94.74 * GIB) and target.chip_config_name == "default"
    assert [Target.parse(name).num_devices for name in ("v5p-8", "v6e-8", "v4-8")] == [4, 8, 4]


def test_hbm_per_chip_is_what_the_compiler_allows_in_bytes():
    assert Target.parse("v5e-1").chip.hbm_bytes == int(15.75 * GIB)
    assert Target.parse("v6e-8").chip.hbm_bytes == int(31.25 * GIB)
    assert Target.parse("v4-8").chip_config_name == "megacore"


@pytest.mark.parametrize("name, words", [("a100-8", "not a TPU slice"), ("v5e-3", "the slices are"),
                                         ("v5p-3", "count TensorCores")])
def test_a_slice_that_does_not_exist_is_named(name, words):
    with pytest.raises(ValueError, match=words):
        Target.parse(name).topology_name
