"""Where each worker sits in the tensor-parallel group, and the groups that do its collectives.

* ``RankPlacement``: global rank, host, and chip on that host, decided by the executor.
* ``GlooGroup``: CPU workers (XLA's CPU backend or native torch). XLA collectives do not
  work across processes on CPU, and gloo on XLA tensors silently returns wrong results, so
  each collective copies to the host, runs gloo there and copies back. It runs outside the
  compiled graph (``torch.compiler.disable``): the compiled step splits at every collective.
* ``XlaGroup``: TPU workers; ``xm.all_reduce`` / ``xm.all_gather`` trace into the compiled
  graph after PJRT's multiprocess initialisation.
* ``tpu_topology_env``: the per-worker TPU environment (one chip per process). Only
  ``Worker.init_device`` applies it.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch

from tpu_executor.models.layers.parallel import TensorParallelGroup

TPU_BASE_PORT = 8476
# Chips of one host laid out as a grid, by how many of them the workers use.
_HOST_CHIP_GRIDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


@dataclass(frozen=True)
class RankPlacement:
    """One worker's place: ``rank`` of ``world_size``; chip ``local_rank`` of the
    ``local_world_size`` used on host ``node_index`` of ``num_nodes``. ``host_ips`` lists the
    hosts in node order; ``master_addr:master_port`` is where rank 0 rendezvous (gloo, or
    JAX's coordinator). On the JAX path a worker is a host's process: ``rank`` is the host's
    index and ``local_world_size`` is 1, whatever chips it holds."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_index: int = 0
    num_nodes: int = 1
    host_ips: Tuple[str, ...] = ("127.0.0.1",)
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.local_world_size * self.num_nodes != self.world_size:
            raise ValueError(f"{self.num_nodes} hosts x {self.local_world_size} workers each is not "
                             f"world_size {self.world_size}: every host must run the same number of workers")
        if len(self.host_ips) != self.num_nodes:
            raise ValueError(f"host_ips lists {len(self.host_ips)} hosts, num_nodes is {self.num_nodes}")


def tpu_topology_env(placement: RankPlacement, host_bounds: Sequence[int] = (1, 1, 1)) -> Dict[str, str]:
    """TPU runtime variables for a one-chip-per-process worker.

    ``host_bounds`` is the grid of hosts (from the TPU VM's metadata on a pod slice); each
    host contributes a grid of ``local_world_size`` chips, so the process grid is their
    element-wise product. Both the current names (``TPU_PROCESS_BOUNDS``...) and the older
    ones (``TPU_HOST_BOUNDS``...) are set, as libtpu versions read either.
    """
    chip_grid = _HOST_CHIP_GRIDS.get(placement.local_world_size)
    if chip_grid is None:
        raise ValueError(f"{placement.local_world_size} workers on one host: a TPU host's chips split "
                         f"into {sorted(_HOST_CHIP_GRIDS)} workers; change tensor_parallel_size")
    process_bounds = ",".join(str(h * c) for h, c in zip(host_bounds, chip_grid))
    ports = [TPU_BASE_PORT + i for i in range(placement.local_world_size)]
    addresses = ",".join(f"{ip}:{port}" for ip in placement.host_ips for port in ports)
    return {
        "TPU_VISIBLE_CHIPS": str(placement.local_rank),
        "CLOUD_TPU_TASK_ID": str(placement.rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": process_bounds,
        "TPU_HOST_BOUNDS": process_bounds,
        "TPU_PROCESS_ADDRESSES": addresses,
        "TPU_PROCESS_PORT": str(ports[placement.local_rank]),
    }


def _to_host(x: torch.Tensor) -> torch.Tensor:
    # A copy even on the CPU: gloo reduces in place and x may be a view of something else.
    return x.detach().to("cpu", copy=True)


class GlooGroup(TensorParallelGroup):
    """Collectives through gloo on host copies (CPU workers); each one is a graph break."""

    collectives_in_graph = False

    def __init__(self, placement: RankPlacement, timeout_s: float):
        super().__init__(placement.rank, placement.world_size)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{placement.master_addr}:{placement.master_port}",
                                rank=placement.rank, world_size=placement.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    @torch.compiler.disable
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        host = _to_host(x)
        dist.all_reduce(host)
        return host.to(x.device)

    @torch.compiler.disable
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        host = _to_host(x)
        parts = [torch.empty_like(host) for _ in range(self.world_size)]
        dist.all_gather(parts, host)
        return torch.cat(parts, dim=-1).to(x.device)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class XlaGroup(TensorParallelGroup):
    """XLA collectives over the TPU chips of all workers, traced into the compiled graph."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        return xm.all_gather(x, dim=x.dim() - 1)

