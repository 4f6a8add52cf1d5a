"""Executors fan one call out to every worker: ``collective_rpc(method, *args)``.

The in-process executor holds one worker; the Ray executor (``ray_executor.py``, tensor
parallelism over chips and hosts) wraps the same ``Worker`` in one actor per chip and exposes
the same interface.
"""
from __future__ import annotations

from typing import Any, List

from tpu_executor.config import EngineConfig
from tpu_executor.worker import Worker


class WorkerFailure(RuntimeError):
    """A worker of a tensor-parallel group died or raised: the group cannot go on, because
    the other ranks' state (and their pending collectives) no longer match it."""


class UniprocExecutor:
    """One worker in this process (one chip, or the CPU)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.workers = [Worker(config)]

    def collective_rpc(self, method: str, *args: Any) -> List[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order."""
        return [getattr(worker, method)(*args) for worker in self.workers]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers = []


def executor_class_for(config: EngineConfig) -> type:
    """Ray actors for tensor parallelism (or when a Ray cluster is named), else in-process."""
    if config.parallel.uses_ray:
        from tpu_executor.ray_executor import RayExecutor

        return RayExecutor
    return UniprocExecutor
