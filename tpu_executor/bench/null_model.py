"""Workers that compute no model, for the host benchmarks: the empty model step (its logits
pick a fixed function of each input token, so the detokenizer sees varied text) and the held
device, a simulated accelerator that takes a fixed time a step without using the host's
cores. Both plug into the real engine through ``ModelRunner.model_steps_class`` and
``ModelRunner.sample_steps``, and into its executors as a ``WorkerMaker``."""
from __future__ import annotations

import dataclasses
import time

import torch

from tpu_executor.worker.launched_step import LaunchedStep
from tpu_executor.worker.model_runner import ModelRunner
from tpu_executor.worker.model_steps import ModelSteps
from tpu_executor.worker.sampler import SamplerOutput
from tpu_executor.worker.sampling_runner import SampleSteps
from tpu_executor.worker.token_feed import fed_input_ids, write_slots
from tpu_executor.worker.worker import Worker


def next_token_ids(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token the empty model step picks after each input token (skipping the special ones)."""
    return (input_ids * 7919 + 13) % (vocab_size - 3) + 3


def next_token_logits(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One-hot logits whose argmax is ``next_token_ids`` (no model compute)."""
    logits = torch.zeros(input_ids.shape[0], vocab_size, device=input_ids.device)
    return logits.scatter(1, next_token_ids(input_ids, vocab_size)[:, None], 1.0)


class NullModelSteps(ModelSteps):
    """Model steps without a model: each token's logits pick ``next_token_ids`` of it."""

    def prefill(self, input_ids, positions, slot_mapping, context_slots, key_positions,
                key_segments, query_segments, logits_indices, kv_caches):
        return self.next_token_logits(input_ids[logits_indices]), None  # no hidden states

    def decode(self, input_ids, feed_slots, feed_tokens, positions, slot_mapping, block_tables,
               context_lens, kv_caches):
        return self.next_token_logits(fed_input_ids(input_ids, feed_slots, feed_tokens))

    def mixed(self, input_ids, positions, slot_mapping, context_slots, key_positions, key_segments,
              query_segments, logits_indices, feed_slots, block_tables, context_lens, feed_tokens, kv_caches):
        """The native path's prefill pack and decode rows in one call, empty too."""
        num_prefill = query_segments.shape[0]
        decode_ids = fed_input_ids(input_ids[num_prefill:], feed_slots, feed_tokens)
        return self.next_token_logits(input_ids[logits_indices]), self.next_token_logits(decode_ids), None

    def next_token_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the empty step hands the sampler for the last tokens ``input_ids``."""
        return next_token_logits(input_ids, self.model.config.vocab_size)


class NullModelRunner(ModelRunner):
    """The model runner with an empty model step: inputs, transfers and the sampler are real."""

    model_steps_class = NullModelSteps


class NullModelWorker(Worker):
    """A worker whose runner computes no model (the checkpoint only gives shapes and vocabulary)."""

    runner_class = NullModelRunner


class HeldModelSteps(NullModelSteps):
    """The empty steps hand the sampler the next ids themselves, not a row of logits each."""

    def next_token_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return next_token_ids(input_ids, self.model.config.vocab_size)


class HeldSampleSteps(SampleSteps):
    """The sampler of the held device: its "logits" are the next ids, and they are the sample."""

    @staticmethod
    def sample(logits, slots, feed_tokens, num_logprobs: int, all_greedy: bool, **sampling):
        if num_logprobs:
            raise ValueError("the held device gives no log-probs")
        out = SamplerOutput(logits, torch.zeros(logits.shape, dtype=torch.float32), None, None)
        return out, write_slots(feed_tokens, slots, logits)


class HeldDeviceRunner(ModelRunner):
    """A simulated accelerator that takes ``device_seconds`` per step. As on XLA, a launch only
    queues the step (behind the steps queued before it) and reading its tokens back waits for
    the device to finish it; the wait holds neither Python's lock nor the host's cores. The
    model and sampler compute nothing on the host (``HeldModelSteps``, ``HeldSampleSteps``),
    so the host's work is the engine's alone. On this CPU a real model, and even the empty
    step's logits and sampler, run on the same two cores as the host work they should hide
    behind; this shows what the engine overlaps when the device is a device. Greedy tokens are
    the empty step's; it gives no log-probs."""

    model_steps_class = HeldModelSteps
    sample_steps = HeldSampleSteps()
    device_seconds = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.collects_late = True  # tokens stay "on the device" until collected, as on XLA
        self._device_free_at = 0.0  # perf_counter() time the queued steps are done

    def launch(self, step):
        launched = super().launch(step)
        self._device_free_at = max(time.perf_counter(), self._device_free_at) + self.device_seconds
        return HeldStep(launched.calls, launched.timer, self._device_free_at)


class HeldStep(LaunchedStep):
    """A step on the simulated device: its tokens can be read once the device is done with it."""

    def __init__(self, calls, timer, done_at: float):
        super().__init__(calls, timer)
        self.done_at = done_at

    def collect(self):
        with self.timer.phase("transfer"):  # where XLA's wait for the device lands too
            time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return super().collect()


@dataclasses.dataclass(frozen=True)
class HeldDeviceWorker:
    """Makes workers on a simulated device that takes ``device_ms`` milliseconds a step; the
    executor calls it as it would a worker class. A record of one number, so it pickles to a
    core in another process, where it builds the worker class itself."""

    device_ms: float

    def __call__(self, *args, **kwargs) -> Worker:
        runner = type("HeldDeviceRunner", (HeldDeviceRunner,), {"device_seconds": self.device_ms / 1e3})
        return type("HeldDeviceWorker", (NullModelWorker,), {"runner_class": runner})(*args, **kwargs)


def held_device_worker(device_ms: float) -> HeldDeviceWorker:
    """What to pass as ``worker_class`` for a device that takes ``device_ms`` a step."""
    return HeldDeviceWorker(device_ms)
