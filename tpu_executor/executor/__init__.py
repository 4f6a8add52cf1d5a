"""Executors: how the engine reaches its workers (in-process, or one Ray actor per chip).

Only ``executor_class_for`` imports the Ray executor, and only when the config asks for it,
so the in-process path never imports Ray.
"""
from __future__ import annotations

from tpu_executor.core.config import EngineConfig
from tpu_executor.executor.base import Executor, WorkerFailure, WorkerLike, WorkerMaker
from tpu_executor.executor.uniproc import UniprocExecutor


def executor_class_for(config: EngineConfig) -> type:
    """Ray actors for tensor parallelism (or when a Ray cluster is named), else in-process."""
    if config.uses_ray:
        from tpu_executor.executor.ray_executor import RayExecutor

        return RayExecutor
    return UniprocExecutor


__all__ = ["Executor", "UniprocExecutor", "WorkerFailure", "WorkerLike", "WorkerMaker", "executor_class_for"]
