"""Tensor-parallel group seam: the only thing model code knows about other ranks.

A model is built for one rank of a group of ``world_size`` ranks. Its parallel layers keep
their shard of each weight and call ``all_reduce`` / ``all_gather`` on the group. The
engine side supplies the group (``tpu_executor/distributed.py``): XLA collectives inside the
compiled graph on TPU, gloo on host copies on CPU. ``SingleRank`` is the tp=1 group; the
layers run the same code with collectives that return their input.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Tuple

import torch


class TensorParallelGroup(ABC):
    """Rank ``rank`` of ``world_size``; subclasses implement the two collectives.

    ``collectives_in_graph`` says whether the collectives can be traced into one compiled
    graph (XLA collectives, or none) or must run between compiled pieces (gloo on CPU).
    """

    collectives_in_graph = True

    def __init__(self, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension, in rank order."""

    def close(self) -> None:
        """Release the group's resources (process groups, sockets)."""


class SingleRank(TensorParallelGroup):
    """The group of one (tp=1): collectives are the identity."""

    def __init__(self):
        super().__init__(0, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


def divide(total: int, parts: int, what: str) -> int:
    """``total / parts``, or a ValueError that names the quantity and the fix."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {parts}; "
                         f"pick a tensor_parallel_size that divides {total}")
    return total // parts


def kv_heads_of_rank(num_kv_heads: int, rank: int, world_size: int) -> Tuple[int, int]:
    """(first KV head, count) that ``rank`` holds. With more ranks than KV heads each KV head
    is replicated on ``world_size / num_kv_heads`` consecutive ranks."""
    if num_kv_heads >= world_size:
        count = divide(num_kv_heads, world_size, "num_key_value_heads")
        return rank * count, count
    if world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} is larger than num_key_value_heads "
                         f"{num_kv_heads} but not a multiple of it, so KV heads cannot be "
                         f"replicated evenly; use a divisor or a multiple of {num_kv_heads}")
    return rank // (world_size // num_kv_heads), 1


def check_tensor_parallel(cfg, world_size: int) -> None:
    """Fail early (before any worker starts) when a checkpoint cannot be split ``world_size`` ways."""
    divide(cfg.num_attention_heads, world_size, "num_attention_heads")
    kv_heads_of_rank(cfg.num_key_value_heads, 0, world_size)
    divide(cfg.intermediate_size, world_size, "intermediate_size")
    if getattr(cfg, "moe_intermediate_size", None):
        divide(cfg.moe_intermediate_size, world_size, "moe_intermediate_size")
