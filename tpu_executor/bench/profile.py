"""Where an engine's time goes, phase by phase: ``tpu-executor bench throughput --profile``.

A ``StepProfile`` attaches a ``PhaseTimer`` to an in-process engine and its model runner. The
device phases (prefill calls, decode calls, the sampler) end with a device synchronisation,
so on XLA each call's time is its own and not the next read-back's. On the native CPU path
the model's time is split further by forward hooks on its modules, exclusive of nested hooked
modules: the linears (LM head included), attention (rotary, KV-cache write and the attention
op), the MoE experts, and the rest of the model (embedding, norms, activations, residuals).
A compiled XLA graph is one call, so there the split stops at prefill / decode / sampler.

With asynchronous scheduling the model runner works on a thread of its own: its phases
(inputs, transfer, model calls, sampler) overlap the engine's (schedule, output, detokenize),
so each side's rows are read against the run's wall time separately; synchronously they add up.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from tpu_executor.core.phase_timer import PhaseTimer

MODEL_PARTS = ("linears", "attention", "moe")
RUNNER_PHASES = ("inputs", "transfer", "prefill", "decode", "mixed", "sample")
MODEL_PHASES = ("prefill", "decode", "mixed")
ENGINE_PHASES = ("schedule", "output", "detokenize")


def _part_classes() -> Dict[str, Tuple[type, ...]]:
    from tpu_executor.models.layers.linear import QuantizableMatmul
    from tpu_executor.models.layers.moe import SparseMoeBlock
    from tpu_executor.models.llama import LlamaAttention

    return {"linears": (QuantizableMatmul,), "attention": (LlamaAttention,), "moe": (SparseMoeBlock,)}


class ModelPartClock:
    """Exclusive wall time of the model's parts, by the device phase that ran them.

    Only for synchronous (eager CPU) execution: a hook's clock is the work's clock there.
    """

    def __init__(self, timer: PhaseTimer):
        self.timer = timer
        self.seconds: Dict[Tuple[str, str], float] = {}
        self._open: List[List] = []  # [part, start, seconds of nested parts]
        self._handles = []

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every module of a known part, and the LM head (a method, not a module call)."""
        classes = _part_classes()
        for module in model.modules():
            part = next((p for p, kinds in classes.items() if isinstance(module, kinds)), None)
            if part is not None:
                self._handles.append(module.register_forward_pre_hook(self._entering(part)))
                self._handles.append(module.register_forward_hook(self._leaving))
        model.compute_logits = self.timed("linears", model.compute_logits)

    def detach(self, model: torch.nn.Module) -> None:
        """Remove the hooks and the LM head's wrapper: the model runs unobserved again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        del model.compute_logits  # the instance attribute; the class's method shows again

    def timed(self, part: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            self._enter(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave()
        return call

    def _entering(self, part: str):
        return lambda module, args: self._enter(part)

    def _leaving(self, module, args, output) -> None:
        self._leave()

    def _enter(self, part: str) -> None:
        self._open.append([part, time.perf_counter(), 0.0])

    def _leave(self) -> None:
        part, start, nested = self._open.pop()
        elapsed = time.perf_counter() - start
        phase = self.timer.active[-1] if self.timer.active else "other"
        self.seconds[(phase, part)] = self.seconds.get((phase, part), 0.0) + elapsed - nested
        if self._open:
            self._open[-1][2] += elapsed



def device_synchronize(device: str) -> Optional[Callable[[], None]]:
    """What waits for the engine's ``device`` (its config's name) to finish its queued work
    (None: it runs synchronously)."""
    if device == "xla":
        import torch_xla.core.xla_model as xm

        return lambda: xm.wait_device_ops()
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(torch.device(device))
    return None


class StepProfile:
    """Phase times of an in-process engine (its one worker), and the model's parts on CPU."""

    def __init__(self, engine):
        self.overlapped = engine.config.scheduler.async_scheduling
        self.timer = PhaseTimer(device_synchronize(engine.config.device.device))
        runner = engine.attach_phase_timer(self.timer)
        self._model = runner.model
        self.parts: Optional[ModelPartClock] = None
        if runner.device.type == "cpu":
            self.parts = ModelPartClock(self.timer)
            self.parts.attach(runner.model)

    def detach(self) -> None:
        """Stop observing the model (the engine keeps this profile's timer until replaced)."""
        if self.parts is not None:
            self.parts.detach(self._model)

    def rows(self) -> List[Tuple[str, str, float, int]]:
        """(engine or runner, what, seconds, calls) in the order a step runs them; a model phase on the
        CPU comes as its parts and the rest of the model."""
        timer = self.timer
        rows = [("engine", phase, timer.seconds.get(phase, 0.0), timer.calls.get(phase, 0)) for phase in ENGINE_PHASES]
        for phase in RUNNER_PHASES:
            total, calls = timer.seconds.get(phase, 0.0), timer.calls.get(phase, 0)
            if self.parts is None or phase not in MODEL_PHASES:
                rows.append(("runner", phase, total, calls))
                continue
            parts = {part: self.parts.seconds.get((phase, part), 0.0) for part in MODEL_PARTS}
            rows += [("runner", f"{phase}: {part}", seconds, calls) for part, seconds in parts.items() if seconds]
            rows.append(("runner", f"{phase}: rest of the model", total - sum(parts.values()), calls))
        return rows


def print_profile(title: str, profile: StepProfile, wall_seconds: float) -> None:
    """The profile as a Markdown table: seconds, share of the wall time, calls, ms per call."""
    print(f"\nProfile of {title}: {wall_seconds:.1f} s wall")
    print("| part | phase | seconds | share of wall | calls | ms per call |\n|---|---|---|---|---|---|")
    totals: Dict[str, float] = {}
    for part, what, seconds, calls in profile.rows():
        side = part if profile.overlapped else "all"
        totals[side] = totals.get(side, 0.0) + seconds
        per_call = f"{1e3 * seconds / calls:.2f}" if calls else "-"
        print(f"| {part} | {what} | {seconds:.2f} | {seconds / wall_seconds:.0%} | {calls} | {per_call} |")
    for side, seconds in totals.items():
        rest = wall_seconds - seconds
        label = f"{side} thread" if profile.overlapped else "engine"
        print(f"| {label} | outside the phases (waiting, loop) | {rest:.2f} | {rest / wall_seconds:.0%} | - | - |")
