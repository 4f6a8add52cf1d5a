"""Executors fan one call out to every worker: ``collective_rpc(method, *args)``.

The single-process executor holds one in-process worker; the Ray executor (tensor
parallelism) wraps the same ``Worker`` in actors and exposes the same interface.
"""
from __future__ import annotations

from typing import Any, List

from tpu_executor.config import EngineConfig
from tpu_executor.worker import Worker


class UniprocExecutor:
    """One worker in this process (one chip, or the CPU)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.workers = [Worker(config, rank=0)]

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> List[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order."""
        return [getattr(worker, method)(*args, **kwargs) for worker in self.workers]

    def shutdown(self) -> None:
        self.workers = []
