"""The in-process executor: one worker in this process (one chip, the CPU, or one GPU)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Type

from tpu_executor.core.config import EngineConfig
from tpu_executor.executor.base import Executor
from tpu_executor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Runs the single worker's methods directly; calls started with ``_start_on_workers``
    (asynchronous steps) run on one thread of its own, in order, so the engine's host work
    overlaps the step (the device work releases the GIL). ``worker_class`` swaps in a subclass
    (tests inject faults with it)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[Type[Worker]] = None):
        super().__init__(config)
        self.workers: List[Worker] = [(worker_class or Worker)(config)]
        self._step_thread: Optional[ThreadPoolExecutor] = None

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        # In-process calls cannot be interrupted: a hung step hangs the caller (timeout unused).
        return [getattr(worker, method)(*args) for worker in self.workers]

    def _start_on_workers(self, method: str, *args: Any,
                          timeout_s: Optional[float] = None) -> Callable[[], List[Any]]:
        """Runs the call on the step thread, behind the calls started before it."""
        if self._step_thread is None:  # started on first use: sync engines never start it
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpu-executor-step")
        return self._step_thread.submit(self._call_workers, method, *args).result

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
        for worker in self.workers:
            worker.close()
        self.workers = []
