"""The engine core in a process of its own (``core_process=True``), as vLLM v1 runs it.

The front-end (``LLMEngine``: text, stop strings, deltas, and in a server the HTTP event loop)
and the core (scheduling, inputs, the executor, recording tokens) then run on different cores
and under different interpreter locks: the core steps as soon as it has work, and the device
never waits for the front-end's work on the previous step. ``CoreProcess`` has the methods of
``EngineCore`` that the front-end calls, over a pipe:

- front-end -> core: ``add`` (the samples of a request), ``finish`` (abort, a stop string),
  ``use_grammars`` (the grammar compiler, rebuilt there from its tokenizer's description),
  ``stats``, ``shutdown``; the core applies them between two steps;
- core -> front-end: each step's ``CoreOutput`` (with the waiting count), the answer to
  ``stats``, and ``dead`` when a worker was lost.

A stop string is found by the front-end while the core may already have run a step or two
more of that sample: those tokens come back and are dropped (the output is unchanged), as
asynchronous scheduling already does for one token.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import sys
from typing import Deque, Optional, Sequence, Set

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.heap import freeze_startup_heap
from tpu_executor.core.phase_timer import NullPhaseTimer
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.engine.core import CoreOutput, EngineCore, EngineDeadError
from tpu_executor.engine.protocols import CoreClient
from tpu_executor.engine.stats import EngineStats
from tpu_executor.executor import Executor, WorkerMaker, executor_class_for

logger = logging.getLogger(__name__)

_SHUTDOWN_WAIT_S = 30.0  # the core stops its workers first (Ray actors take a few seconds)


class CoreProcess:
    """``EngineCore`` in a spawned process. Start-up waits until the core's workers are up (or
    raises the error that stopped them)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[WorkerMaker] = None, show_progress: bool = True):
        context = multiprocessing.get_context("spawn")  # never fork a process holding a device or Ray
        self._conn, child = context.Pipe()
        self._process = context.Process(target=run_core, args=(child, core_config(config), worker_class, show_progress),
                                        name="engine-core", daemon=True)
        self._process.start()
        child.close()
        self.config = config
        self.dead_reason: Optional[str] = None
        self.timer = NullPhaseTimer()  # the core's phases are timed in its own process
        self._live: Set[str] = set()  # samples the core has not reported finished
        self._stats: Optional[EngineStats] = None  # the latest answer, for after the core is gone
        self._outputs: Deque[CoreOutput] = collections.deque()  # received while waiting for stats
        self._num_waiting = 0
        kind, *answer = self._receive()
        if kind != "ready":
            self._process.join(_SHUTDOWN_WAIT_S)
            self._conn.close()
            # A process that exits before it can report is most often a script without a
            # __main__ guard: the spawned core imports the main module again.
            hint = "" if kind == "failed" else (" (its output above says why; a script that starts it must guard "
                                                "its entry point with `if __name__ == \"__main__\":`)")
            raise RuntimeError(f"the engine core failed to start: {answer[0]}{hint}")
        self.vocab_size, self.startup_seconds, max_model_len = answer
        self.config = dataclasses.replace(self.config, max_model_len=max_model_len)  # as the core fitted it

    # ---- EngineCore's methods -----------------------------------------------------------
    def add(self, samples: Sequence[Request]) -> None:
        self._live.update(sample.request_id for sample in samples)
        self._send("add", list(samples))

    def finish(self, sample_ids: Sequence[str], status: RequestStatus) -> None:
        """The samples stay live until the core's output confirms them: tokens of theirs may
        still be on the way. Once the core is gone there is nothing to tell it."""
        if sample_ids and self.dead_reason is None:
            self._send("finish", list(sample_ids), status)

    def use_grammars(self, compiler) -> None:
        self._send("use_grammars", compiler)

    def forget_lora(self, lora_int_id: int) -> None:
        if self.dead_reason is None:
            self._send("forget_lora", lora_int_id)

    def has_sample(self, sample_id: str) -> bool:
        return sample_id in self._live

    def has_unfinished(self) -> bool:
        """Whether a sample is still live in the core, or an output waits to be read."""
        if self._live or self._outputs:
            return True
        return self.dead_reason is None and not self._conn.closed and self._conn.poll()

    @property
    def num_waiting(self) -> int:
        """The core's waiting samples, as of its latest output."""
        return self._num_waiting

    def step(self) -> CoreOutput:
        """The core's next step output: waits for it while a sample is live, else takes one
        only if it is there (a step still finishing samples the front-end already ended)."""
        if self._outputs:
            return self._outputs.popleft()
        if not self._live and (self.dead_reason is not None or not self._conn.poll()):
            return CoreOutput()
        return self._next_output()

    def stats(self) -> EngineStats:
        """The core's figures, asked between two of its steps (once it is gone, the last
        figures it gave)."""
        if self.dead_reason is not None:
            return self._stats or EngineStats(startup_seconds=dict(self.startup_seconds))
        self._send("stats")
        while True:
            kind, *answer = self._receive()
            if kind == "stats":
                self._stats = answer[0]
                return self._stats
            self._outputs.append(self._output_of(kind, answer))

    def shutdown(self) -> None:
        """Stop the core's workers and its process (idempotent)."""
        if self._process.is_alive():
            try:
                self._conn.send(("shutdown",))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(_SHUTDOWN_WAIT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    # ---- the pipe -----------------------------------------------------------------------
    def _send(self, *message) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine core has shut down: {self.dead_reason}")
        self._conn.send(message)

    def _receive(self) -> tuple:
        """The core's next message; its process ending counts as a lost core."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join(_SHUTDOWN_WAIT_S)
            return ("dead", f"the engine core process exited (code {self._process.exitcode})",
                    "engine core process exited")

    def _next_output(self) -> CoreOutput:
        kind, *answer = self._receive()
        return self._output_of(kind, answer)

    def _output_of(self, kind: str, answer: list) -> CoreOutput:
        """A step output message's output; a ``dead`` message raises EngineDeadError."""
        if kind == "dead":
            message, self.dead_reason = answer
            self._live.clear()
            raise EngineDeadError(message)
        output, self._num_waiting = answer
        self._live.difference_update(output.finished)
        return output


def start_core(config: EngineConfig, executor: Optional[Executor] = None, worker_class: Optional[WorkerMaker] = None,
               show_progress: bool = True) -> CoreClient:
    """The engine core the config asks for: in this process over ``executor`` (default: the
    config's, with ``worker_class`` if given), or in a process of its own (``core_process``)."""
    if config.scheduler.core_process:
        if executor is not None:
            raise ValueError("core_process runs the executor in the core's own process; do not pass one")
        return CoreProcess(config, worker_class, show_progress)
    if executor is None:
        executor = executor_class_for(config)(config, worker_class=worker_class)
    return EngineCore(config, executor, show_progress)


def core_config(config: EngineConfig) -> EngineConfig:
    """The config the core process starts from. Without a ``ray_address`` the Ray executor
    joins the cluster its process is connected to: for a spawned core that is the cluster the
    front-end's process is connected to, so it is named by address."""
    ray = sys.modules.get("ray")  # connected only if already imported: never import Ray for this
    if not config.uses_ray or config.parallel.ray_address is not None or ray is None \
            or not ray.is_initialized():
        return config
    parallel = dataclasses.replace(config.parallel, ray_address=ray.get_runtime_context().gcs_address)
    return dataclasses.replace(config, parallel=parallel)


def run_core(conn, config: EngineConfig, worker_class: Optional[WorkerMaker], show_progress: bool) -> None:
    """The core process: start the workers, then step while there is work, applying the
    front-end's messages between steps."""
    try:
        executor = executor_class_for(config)(config, worker_class=worker_class)
        core = EngineCore(config, executor, show_progress)
    except BaseException as err:  # noqa: BLE001 - reported to the front-end, which raises it
        logger.exception("the engine core failed to start")
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    freeze_startup_heap()
    conn.send(("ready", core.vocab_size, core.startup_seconds, core.config.max_model_len))
    try:
        while _apply_messages(conn, core, wait=not core.has_unfinished()):
            if core.has_unfinished():
                output = core.step()
                conn.send(("output", output, core.num_waiting))
    except EngineDeadError as err:
        conn.send(("dead", str(err), core.dead_reason))
    except BaseException as err:  # noqa: BLE001 - a bug in the loop: nothing can step any more
        logger.exception("the engine core loop failed")
        core.shutdown()
        conn.send(("dead", f"the engine core failed: {type(err).__name__}: {err}", str(err)))


def _apply_messages(conn, core: EngineCore, wait: bool) -> bool:
    """Apply every message the front-end has sent (waiting for one if ``wait``); False once
    it asks for shutdown (the workers are stopped then)."""
    while wait or conn.poll():
        wait = False
        try:
            kind, *args = conn.recv()
        except EOFError:  # the front-end is gone
            kind, args = "shutdown", []
        if kind == "shutdown":
            core.shutdown()
            return False
        if kind == "stats":
            conn.send(("stats", core.stats()))
        else:
            getattr(core, kind)(*args)  # add, finish, use_grammars, forget_lora
    return True
