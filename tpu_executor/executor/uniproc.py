"""The in-process executor: one worker in this process (one chip, the CPU, or one GPU)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional

from tpu_executor.core.config import EngineConfig
from tpu_executor.executor.base import Executor, WorkerFailure, WorkerLike, WorkerMaker
from tpu_executor.worker.model_runner import ModelRunner
from tpu_executor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Runs the single worker's methods in this process, every call on one thread of the
    executor's own (the step thread), in the order they were started: with asynchronous
    scheduling the engine's host work overlaps the step there (the device work releases the
    GIL). ``worker_class`` swaps in a subclass (tests inject faults with it)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[WorkerMaker] = None):
        super().__init__(config)
        self.workers: List[WorkerLike] = [(worker_class or Worker)(config)]
        # Every call, not only the steps, and in a synchronous engine too: torch's CPU ops run
        # on an OpenMP team per calling thread, and with a second team alive (warm-up's on the
        # caller's thread, or an earlier engine's) libgomp counts more threads than cores and
        # stops spinning between parallel regions. Measured on 2 cores: the native path's
        # asynchronous engine ran 10-14% below the synchronous one that way. The thread ends
        # with the executor, and its team with it.
        self._step_thread: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tpu-executor-step")

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        # In-process calls cannot be interrupted: a hung step hangs the caller (timeout unused).
        return self._start_on_workers(method, *args)()

    def _run_on_workers(self, method: str, *args: Any) -> List[Any]:
        return [getattr(worker, method)(*args) for worker in self.workers]

    def _start_on_workers(self, method: str, *args: Any,
                          timeout_s: Optional[float] = None) -> Callable[[], List[Any]]:
        """Runs the call on the step thread, behind the calls started before it."""
        if self._step_thread is None:
            raise WorkerFailure(f"cannot call {method}: the worker has been shut down")
        return self._step_thread.submit(self._run_on_workers, method, *args).result

    def attach_phase_timer(self, timer) -> "ModelRunner":
        worker = self.workers[0]
        if not isinstance(worker, Worker):
            raise ValueError(f"phase timing needs a Worker's model runner; {type(worker).__name__} has none")
        runner = worker.runner
        runner.timer = timer
        return runner

    def shutdown(self) -> None:
        if self._step_thread is None:
            return
        try:
            self._call_workers("close")
        finally:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
            self.workers = []
