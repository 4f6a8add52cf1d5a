"""The in-process executor: one worker in this process (one chip, the CPU, or one GPU)."""
from __future__ import annotations

from typing import Any, List, Optional, Type

from tpu_executor.core.config import EngineConfig
from tpu_executor.executor.base import Executor
from tpu_executor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Runs the single worker's methods directly. ``worker_class`` swaps in a subclass (tests
    inject faults with it)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[Type[Worker]] = None):
        super().__init__(config)
        self.workers: List[Worker] = [(worker_class or Worker)(config)]

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        # In-process calls cannot be interrupted: a hung step hangs the caller (timeout unused).
        return [getattr(worker, method)(*args) for worker in self.workers]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers = []
