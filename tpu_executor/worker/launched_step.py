"""A launched step's handles: its sampler calls' device outputs, read back into tokens by
``LaunchedStep.collect()`` (the model runner launches; the worker collects, possibly a step
later on XLA)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Tuple

from tpu_executor.core.step import LoRAFailure, ModelRunnerOutput, SampledTokens
from tpu_executor.worker.prompt_logprobs import read_back
from tpu_executor.worker.sampler import SamplerOutput
from tpu_executor.worker.verify import accepted_rows

if TYPE_CHECKING:
    import torch


class LaunchedCall(NamedTuple):
    """One sampler call of a launched step: its work items, the request of each row (None: a
    row that gives no token), whether any asked for log-probs, the sampler's device outputs,
    the rows that give a token (None: every work item's row), the prompt log-probs the call's
    prefill launched (device outputs and their owners), and for a call that verifies its pack
    (its rows, from ``verified_from`` on, are every position of the pack; the accepted ones are
    kept, known once read back)."""

    work: Sequence
    request_ids: Sequence[Optional[str]]
    returns_logprobs: bool
    out: SamplerOutput
    kept_rows: Optional[List[int]]
    prompt: Sequence = ()
    verified: Sequence = ()
    verified_from: int = 0


class LaunchedStep:
    """A step handed to the device; ``collect()`` reads its tokens back (waiting for the device)."""

    def __init__(self, calls: List[LaunchedCall], timer):
        self.calls = calls
        self.timer = timer

    def collect(self) -> ModelRunnerOutput:
        """The step's tokens, one per sampled request, in the order of its calls, and the
        prompt log-probs its prefills gave."""
        parts, prompt = [], []
        for call in self.calls:
            with self.timer.phase("transfer"):
                host = _read_back(call.out)
                prompt.extend(call.prompt)
            with self.timer.phase("output"):
                sampled = _sampled_tokens(call, host)
                kept = _verified_rows(call, host[0]) if call.verified else call.kept_rows
                parts.append(sampled if kept is None else sampled.rows(kept))
        with self.timer.phase("transfer"):
            prompt_logprobs = read_back(prompt) if prompt else ()
        return ModelRunnerOutput(SampledTokens.concat(parts), prompt_logprobs=prompt_logprobs)


def _verified_rows(call: LaunchedCall, token_ids: list) -> List[int]:
    """The rows a call that verifies keeps: those before its verifies, then the accepted ones."""
    first = call.verified_from
    return list(range(first)) + [first + row for row in accepted_rows(call.verified, token_ids[first:])]


def _read_back(out: SamplerOutput) -> Tuple[list, list, Optional[list], Optional[list]]:
    """The sampler's outputs as host lists (waits for the device)."""
    def as_list(tensor: Optional[torch.Tensor]) -> Optional[list]:
        return None if tensor is None else tensor.cpu().tolist()

    return as_list(out.token_ids), as_list(out.token_logprobs), as_list(out.top_ids), as_list(out.top_logprobs)


def _sampled_tokens(call: LaunchedCall, host: Tuple[list, list, Optional[list], Optional[list]]) -> SampledTokens:
    """The rows of ``call``'s work (the padding rows after them are dropped)."""
    token_ids, logprobs, top_ids, top_lps = host
    num = len(call.work)
    top = None
    if call.returns_logprobs:
        top = []
        for row, item in enumerate(call.work):
            wanted = item.sampling.num_logprobs  # -1: the request asked for no log-probs
            top.append(None if wanted < 0 else
                       dict(zip(top_ids[row][:wanted], top_lps[row][:wanted])) if wanted and top_ids else {})
    return SampledTokens(list(call.request_ids), token_ids[:num], logprobs[:num], top)


class WithLoRAFailures:
    """A launched step whose output also names the adapters its slots could not take."""

    def __init__(self, launched: "LaunchedStep", failures: Tuple[LoRAFailure, ...]):
        self.launched, self.failures = launched, failures

    def collect(self) -> ModelRunnerOutput:
        return dataclasses.replace(self.launched.collect(), lora_failures=self.failures)
