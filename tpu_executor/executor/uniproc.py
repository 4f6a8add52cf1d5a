"""The in-process executor: one worker in this process (one chip, the CPU, or one GPU)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Type

from tpu_executor.core.config import EngineConfig
from tpu_executor.executor.base import Executor
from tpu_executor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Runs the single worker's methods in this process. With asynchronous scheduling every
    call runs on one thread of its own (the step thread), in order, so the engine's host work
    overlaps the step (the device work releases the GIL); a synchronous engine calls the worker
    directly. ``worker_class`` swaps in a subclass (tests inject faults with it)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[Type[Worker]] = None):
        super().__init__(config)
        self.workers: List[Worker] = [(worker_class or Worker)(config)]
        # All of the worker's calls (loading, warm-up, steps) share the step thread, not only
        # the steps: torch's CPU ops run on an OpenMP team per calling thread, and with a
        # second team alive (warm-up's, on the engine's thread) libgomp counts more threads
        # than cores and stops spinning between parallel regions. Measured on 2 cores: the
        # native path's asynchronous engine ran 14% below the synchronous one that way.
        self._step_thread: Optional[ThreadPoolExecutor] = None
        if config.scheduler.async_scheduling:
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpu-executor-step")

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        # In-process calls cannot be interrupted: a hung step hangs the caller (timeout unused).
        if self._step_thread is not None:
            return self._step_thread.submit(self._run_on_workers, method, *args).result()
        return self._run_on_workers(method, *args)

    def _run_on_workers(self, method: str, *args: Any) -> List[Any]:
        return [getattr(worker, method)(*args) for worker in self.workers]

    def _start_on_workers(self, method: str, *args: Any,
                          timeout_s: Optional[float] = None) -> Callable[[], List[Any]]:
        """Runs the call on the step thread, behind the calls started before it (a
        synchronous engine has none and runs it before returning)."""
        if self._step_thread is None:
            return super()._start_on_workers(method, *args, timeout_s=timeout_s)
        return self._step_thread.submit(self._run_on_workers, method, *args).result

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
        for worker in self.workers:
            worker.close()
        self.workers = []
