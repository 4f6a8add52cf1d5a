"""TPU slices by name: each generation's chip (HBM in bytes, bandwidths, peak compute) and how
a slice of it is laid out (topology, chips per host), in one table.

Chip figures are Google Cloud's published per-chip specifications (cloud.google.com/tpu/docs/
v4, v5e, v5p-training, v6e, tpu7x). Slice names count chips for v5e/v6e (``v5e-8``: 8 chips) and
TensorCores for v4/v5p/tpu7x (``v5p-8``, ``tpu7x-8``: 4 chips), as Cloud's accelerator types do.
The layouts are Cloud's: a v5e/v6e host holds up to 8 chips (one host up to ``-8``, 4 chips a
host above); a v4/v5p/tpu7x host holds 4 chips (2x2x1).

A device is what JAX and the mesh hold: a chip on v5e/v6e and on v4/v5p (whose two TensorCores
run as one, megacore), a TensorCore on tpu7x (Ironwood's two TensorCores are two devices, each
with half the chip's HBM, bandwidth and compute). ``Chip`` holds one device's figures.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Tuple

GIB = 1 << 30


@dataclass(frozen=True)
class Chip:
    """One generation's device (a chip, or a TensorCore where a chip is two devices): memory,
    bandwidths and peak compute."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    peak_flops: float  # bf16 (fp32 for a measured CPU)
    ici_bytes_per_s: float  # bidirectional, per device
    cores_per_chip: int = 1
    devices_per_chip: int = 1


# HBM is what libtpu's compiler lets one chip's programs use (its out-of-memory message: "Used
# ... of 15.75G hbm" on a v5e), a little under the published 16/32/95 GiB: the runtime keeps
# the rest; on tpu7x, libtpu's figure for one TensorCore (94.74 GiB of the chip's 192 GiB).
TPUS: Dict[str, Chip] = {
    "v4": Chip("v4", int(30.75 * GIB), 1200e9, 275e12, 300e9, cores_per_chip=2),  # ICI: not on the page; assumed
    "v5e": Chip("v5e", int(15.75 * GIB), 819e9, 197e12, 400e9),
    "v5p": Chip("v5p", int(95.74 * GIB), 2765e9, 459e12, 1200e9, cores_per_chip=2),
    "v6e": Chip("v6e", int(31.25 * GIB), 1638e9, 918e12, 800e9),
    # Per TensorCore: half of 7,380 GB/s, 2,307 TFLOP/s and 1,200 GB/s of ICI a chip.
    "tpu7x": Chip("tpu7x", int(94.74 * GIB), 3690e9, 1153.5e12, 600e9, cores_per_chip=2, devices_per_chip=2),
}
# Chips -> the slice's 2-D grid (v5e, v6e) or 3-D grid (v4, v5p, tpu7x).
GRIDS_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
GRIDS_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8)}
# The names JAX gives each generation's devices (``device_kind``).
DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "tpu7x": "TPU7x"}


@dataclass(frozen=True)
class Target:
    """A slice: ``num_chips`` chips of one kind, the model sharded over all their devices."""

    chip: Chip
    num_chips: int

    @property
    def name(self) -> str:
        return f"{self.chip.name}-{self.num_chips * self.chip.cores_per_chip}"

    @classmethod
    def parse(cls, name: str) -> "Target":
        match = re.fullmatch(r"(v4|v5e|v5p|v6e|tpu7x)-(\d+)", name)
        if not match:
            raise ValueError(f"target {name!r} is not a TPU slice like v5e-8; generations: {sorted(TPUS)}")
        chip = TPUS[match.group(1)]
        count = int(match.group(2))
        if count % chip.cores_per_chip:
            raise ValueError(f"{name}: {chip.name} slices count TensorCores ({chip.cores_per_chip} a chip)")
        return cls(chip, count // chip.cores_per_chip)

    @property
    def num_devices(self) -> int:
        """The devices of the slice: the mesh's size, the most chips a model splits over."""
        return self.num_chips * self.chip.devices_per_chip

    @property
    def device_noun(self) -> str:
        """What one device of the slice is, for reports: "chip", or "TensorCore" on tpu7x."""
        return "TensorCore" if self.chip.devices_per_chip > 1 else "chip"

    @property
    def is_3d(self) -> bool:
        return self.chip.name in ("v4", "v5p", "tpu7x")

    @property
    def grid(self) -> Tuple[int, ...]:
        """The slice's chip grid, or a ValueError naming the sizes Cloud offers."""
        grids = GRIDS_3D if self.is_3d else GRIDS_2D
        if self.num_chips not in grids:
            sizes = ", ".join(f"{self.chip.name}-{n * self.chip.cores_per_chip}" for n in grids)
            raise ValueError(f"target {self.name}: no such {self.chip.name} slice; the slices are {sizes}")
        return grids[self.num_chips]

    @property
    def topology_name(self) -> str:
        """The topology as libtpu names it, e.g. ``v6e:2x4``."""
        return f"{self.chip.name}:{'x'.join(map(str, self.grid))}"

    @property
    def chips_per_host_bounds(self) -> Tuple[int, int, int]:
        """One host's share of the grid (x, y, z)."""
        if self.is_3d:
            return (2, 2, 1)
        grid = self.grid
        return (grid[0], grid[1], 1) if self.num_chips <= 8 else (2, 2, 1)

    @property
    def num_hosts(self) -> int:
        per_host = 1
        for bound in self.chips_per_host_bounds:
            per_host *= bound
        return self.num_chips // per_host

    @property
    def chip_config_name(self) -> str:
        """v4's two TensorCores act as one device (megacore), as JAX runs them."""
        return "megacore" if self.chip.name == "v4" else "default"

    @property
    def device_kind(self) -> str:
        return DEVICE_KINDS[self.chip.name]
