"""The executor contract: the engine's only way to reach its workers.

An executor holds one worker per chip and offers the engine typed calls (``init_device``,
``load_model``, ..., ``execute_model(step)``, ``stats()``, ``shutdown()``). This module is the
one place that names worker methods; a concrete executor only says how to call one method on
every worker (``_call_workers``, and ``_start_on_workers`` to start it without waiting): in this
process, or on Ray actors.

Failure model: an exception inside a worker's step comes back as ``ModelRunnerOutput.error``
and fails that step's requests, on every executor alike; an adapter that a rank could not write
into its slot comes back in ``ModelRunnerOutput.lora_failures`` (merged over the ranks) and
fails only that adapter's requests. A worker that dies, stops answering,
or disagrees with the other ranks about whether the step ran is a ``WorkerFailure``: the group
cannot go on.
"""
from __future__ import annotations

import abc
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from tpu_executor.core.buckets import Graph
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.step import LoRAFailure, ModelRunnerOutput, SchedulerOutput, WorkerStats


@runtime_checkable
class WorkerLike(Protocol):
    """What an executor calls on each of its workers (``Executor`` names every call): the
    ``Worker`` of one chip, or a stand-in such as the tuner's ``NullWorker``."""

    def init_device(self) -> str:
        """Bind this rank's device; returns its name."""

    def load_model(self) -> int:
        """Load this rank's shard; returns the vocabulary size."""

    def determine_num_blocks(self) -> int:
        """KV blocks this rank's memory holds."""

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV cache."""

    def warmup(self, show_progress: bool) -> None:
        """Compile the bucket plan's graphs (note the kernels on eager devices)."""

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its tokens."""

    def launch_step(self, step: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Start one step; its output, or None while its tokens are still on the device."""

    def collect_step(self) -> ModelRunnerOutput:
        """The tokens of the oldest launched step that answered None."""

    def time_graphs(self, graphs: List[Graph], repeats: int) -> List[float]:
        """Median seconds of each graph on padding-only inputs."""

    def stats(self) -> WorkerStats:
        """This rank's compile, padding and cache figures."""

    def close(self) -> None:
        """Release the device and leave the group."""


# A ``Worker`` class, or anything that makes a ``WorkerLike`` from (config) in this process or
# (config, placement) on a Ray actor: tests inject faults and benchmarks a held device with it.
WorkerMaker = Callable[..., WorkerLike]


class WorkerFailure(RuntimeError):
    """A worker died, stopped answering, or fell out of step with the others: the group cannot
    go on, because the ranks' state (and their pending collectives) no longer match."""


class Executor(abc.ABC):
    """Fans each call out to every worker of the tensor-parallel group, in rank order."""

    def __init__(self, config: EngineConfig):
        self.config = config

    @abc.abstractmethod
    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        """Call ``Worker.<method>(*args)`` on every worker; one result per rank. Raises
        ``WorkerFailure`` when a worker dies or raises, or (out-of-process workers) when no
        rank answers for ``timeout_s``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their devices (idempotent)."""

    # ---- start-up, in this order ---------------------------------------------------------
    def init_device(self) -> None:
        self._call_workers("init_device")

    def load_model(self) -> int:
        """Load every worker's shard; returns the vocabulary size."""
        return self._call_workers("load_model")[0]

    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold: the smallest worker's count."""
        return min(self._call_workers("determine_num_blocks"))

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate every worker's cache; ``max_model_len`` is the context the cache was
        fitted to (``core/config.py: fit_max_model_len``)."""
        self._call_workers("init_cache", num_blocks, max_model_len)

    def warmup(self, show_progress: bool) -> None:
        """Compile every graph of the bucket plan on every worker."""
        self._call_workers("warmup", show_progress)

    # ---- serving -------------------------------------------------------------------------
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; returns rank 0's tokens (all ranks sample alike)."""
        return agree_on_step(self._call_workers("execute_model", step,
                                                timeout_s=self.config.parallel.step_timeout_s))

    def execute_model_async(self, step: SchedulerOutput) -> "StartedStep":
        """Start one step and return at once; ``result()`` is ``execute_model``'s answer (or
        raises what it would raise). Steps run in the order they were started, and results are
        read in that order: the engine starts step N+1 before it reads step N, so on XLA every
        worker has queued N+1 on its device before it reads N's tokens back."""
        timeout_s = self.config.parallel.step_timeout_s
        launched = self._start_on_workers("launch_step", step, timeout_s=timeout_s)
        return StartedStep(launched, lambda: self._start_on_workers("collect_step", timeout_s=timeout_s)())

    def _start_on_workers(self, method: str, *args: Any,
                          timeout_s: Optional[float] = None) -> Callable[[], List[Any]]:
        """Start ``Worker.<method>(*args)`` on every worker; returns a function that waits for
        the results (one per rank, failing as ``_call_workers`` does). Calls started this way
        run in the order they were started. This default runs the call before returning;
        executors that can overlap override it."""
        results = self._call_workers(method, *args, timeout_s=timeout_s)
        return lambda: results

    def time_graphs(self, graphs: Sequence[Graph], repeats: int = 3) -> List[float]:
        """Seconds per run of each graph, rank 0's (every rank runs the same shapes)."""
        return self._call_workers("time_graphs", list(graphs), repeats)[0]

    def attach_phase_timer(self, timer) -> Any:
        """Time the model runner's phases with ``timer`` (benchmarks); returns the runner.
        Only a worker in this process has a runner to time."""
        raise ValueError(f"phase timing needs the in-process executor, not {type(self).__name__} "
                         "(tensor_parallel_size 1, no ray_address)")

    def stats(self) -> WorkerStats:
        return WorkerStats.combine(self._call_workers("stats"))


class StartedStep:
    """A step launched on every worker (``Worker.launch_step``); ``result()`` is what
    ``execute_model`` would answer. ``launched()`` waits for each rank's launch answer;
    ``collect()`` asks each rank for ``collect_step``, for when the tokens were left on the
    devices (every rank answered None)."""

    def __init__(self, launched: Callable[[], List[Optional[ModelRunnerOutput]]],
                 collect: Callable[[], List[ModelRunnerOutput]]):
        self._launched = launched
        self._collect = collect

    def result(self) -> ModelRunnerOutput:
        outputs = self._launched()
        if all(out is None for out in outputs):
            outputs = self._collect()
        # A rank that failed to launch while another launched is out of step: agree_on_step raises.
        return agree_on_step([out if out is not None else ModelRunnerOutput() for out in outputs])


def agree_on_step(outputs: Sequence[ModelRunnerOutput]) -> ModelRunnerOutput:
    """Rank 0's output when every rank ran the step, or every rank failed it with the same
    error (a deterministic failure: the ranks stopped at the same point, in step), with the
    adapters that any rank failed to write (``merged_lora_failures``). Anything else (one rank
    failed, or the others then timed out in a collective waiting for it) leaves the ranks'
    caches and collectives out of step: fatal. A drafter's failure after the step ran
    (``draft_error``) is held to the same rule."""
    if len({(out.error, out.draft_error) for out in outputs}) == 1:
        failures = merged_lora_failures(outputs)
        return outputs[0] if failures == outputs[0].lora_failures else replace(outputs[0], lora_failures=failures)
    ranks = "; ".join(f"rank {rank}: {out.error or out.draft_error or 'ran it'}" for rank, out in enumerate(outputs))
    raise WorkerFailure(f"the workers fell out of step ({ranks})")


def merged_lora_failures(outputs: Sequence[ModelRunnerOutput]) -> Tuple[LoRAFailure, ...]:
    """Each (slot, adapter) that any rank failed to write, once, with the first such rank's
    message. A rank's failed write leaves its slot empty while the others hold the adapter:
    the step still ran in step on every rank (a slot's rows stay its own), and the engine
    fails that adapter's requests and has every rank empty the slot."""
    merged: Dict[Tuple[int, int], LoRAFailure] = {}
    for out in outputs:
        for failure in out.lora_failures:
            merged.setdefault((failure.slot, failure.lora_int_id), failure)
    return tuple(merged.values())
