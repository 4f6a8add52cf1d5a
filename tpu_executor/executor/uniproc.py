"""The in-process executor: one worker in this process (one chip, the CPU, or one GPU)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Type

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.step import SchedulerOutput
from tpu_executor.executor.base import Executor, StartedStep
from tpu_executor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Runs the single worker's methods directly; ``execute_model_async`` runs steps on one
    thread of its own, in order, so the engine's host work overlaps the step (the device work
    releases the GIL). ``worker_class`` swaps in a subclass (tests inject faults with it)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[Type[Worker]] = None):
        super().__init__(config)
        self.workers: List[Worker] = [(worker_class or Worker)(config)]
        self._step_thread: Optional[ThreadPoolExecutor] = None

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        # In-process calls cannot be interrupted: a hung step hangs the caller (timeout unused).
        return [getattr(worker, method)(*args) for worker in self.workers]

    def execute_model_async(self, step: SchedulerOutput) -> StartedStep:
        """Launch the step on the step thread. Its result, when asked for, is collected on the
        same thread, behind whatever was launched in between (the next step, on XLA)."""
        if self._step_thread is None:  # started on first use: sync engines never start it
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpu-executor-step")
        thread = self._step_thread
        launched = thread.submit(self._call_workers, "launch_step", step)
        return StartedStep(launched.result, lambda: thread.submit(self._call_workers, "collect_step").result())

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
        for worker in self.workers:
            worker.close()
        self.workers = []
