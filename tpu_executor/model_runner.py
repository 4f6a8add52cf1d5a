"""Model runner: host-side input preparation, bucket padding, compiled model step and sampler.

A prefill runs one sequence padded to a prefill bucket; a decode runs a batch padded to a
(batch, context-blocks) bucket. Model step and sampler are separately compiled functions, so
their graph counts add instead of multiplying. On the native path (device "cpu") the same code
runs eagerly.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Sequence, Tuple

import torch
from tqdm import tqdm

from models.layers.attention import AttentionMetadata
from tpu_executor.compilation import CompileGuard, pick_bucket
from tpu_executor.config import EngineConfig
from tpu_executor.kv_cache_manager import NULL_BLOCK
from tpu_executor.sampler import SamplerOutput, sample
from tpu_executor.scheduler import DecodeWork, PrefillWork, SampledToken, SamplingMeta, SchedulerOutput

logger = logging.getLogger(__name__)

_GREEDY = SamplingMeta(0.0, 0, 1.0, 0.0, 0, 0, -1)


class StepInputs:
    """The model step's tensors (host side until ``to``)."""

    FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "logits_indices")

    def __init__(self, **tensors: torch.Tensor):
        for name in self.FIELDS:
            setattr(self, name, tensors[name])

    def to(self, device: torch.device) -> "StepInputs":
        return StepInputs(**{name: getattr(self, name).to(device) for name in self.FIELDS})

    def as_args(self) -> Tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)


def prefill_inputs(work: PrefillWork, bucket: int, block_size: int) -> StepInputs:
    """One sequence's new tokens at the front of a ``bucket``-long padded row."""
    num_new = len(work.token_ids)
    positions = torch.zeros(bucket, dtype=torch.int64)
    positions[:num_new] = torch.arange(work.start_pos, work.start_pos + num_new)
    input_ids = torch.zeros(bucket, dtype=torch.int64)
    input_ids[:num_new] = torch.tensor(work.token_ids, dtype=torch.int64)
    blocks = torch.full((bucket // block_size,), NULL_BLOCK, dtype=torch.int64)
    blocks[:len(work.block_ids)] = torch.tensor(work.block_ids, dtype=torch.int64)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    slots[num_new:] = NULL_BLOCK * block_size
    return StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slots,
                      block_tables=blocks[None, :],
                      context_lens=torch.tensor([work.start_pos + num_new], dtype=torch.int64),
                      logits_indices=torch.tensor([num_new - 1], dtype=torch.int64))


def decode_inputs(work: Sequence[DecodeWork], batch: int, width: int, block_size: int) -> StepInputs:
    """A decode batch padded to ``batch`` rows and ``width`` block-table entries."""
    input_ids = torch.zeros(batch, dtype=torch.int64)
    positions = torch.zeros(batch, dtype=torch.int64)
    slots = torch.full((batch,), NULL_BLOCK * block_size, dtype=torch.int64)
    tables = torch.full((batch, width), NULL_BLOCK, dtype=torch.int64)
    for row, item in enumerate(work):
        input_ids[row] = item.token_id
        positions[row] = item.position
        tables[row, :len(item.block_ids)] = torch.tensor(item.block_ids, dtype=torch.int64)
        slots[row] = item.block_ids[item.position // block_size] * block_size + item.position % block_size
    return StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slots,
                      block_tables=tables, context_lens=positions + 1,
                      logits_indices=torch.arange(batch, dtype=torch.int64))


def sampling_tensors(metas: Sequence[SamplingMeta], batch: int) -> Dict[str, torch.Tensor]:
    """Per-row sampler inputs padded to ``batch`` rows (padding rows are greedy)."""
    rows = list(metas) + [_GREEDY] * (batch - len(metas))
    return {
        "temperature": torch.tensor([m.temperature for m in rows], dtype=torch.float32),
        "top_k": torch.tensor([m.top_k for m in rows], dtype=torch.int64),
        "top_p": torch.tensor([m.top_p for m in rows], dtype=torch.float32),
        "min_p": torch.tensor([m.min_p for m in rows], dtype=torch.float32),
        "seeds": torch.tensor([m.seed for m in rows], dtype=torch.int64),
        "steps": torch.tensor([m.step for m in rows], dtype=torch.int64),
    }


class ModelRunner:
    """Runs scheduled work on one device and returns one sampled token per request."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device):
        self.config = config
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = config.cache.block_size
        self.guard = CompileGuard(config.compile.strict)
        compiled = device.type == "xla"
        if compiled:
            _raise_dynamo_limits(self.num_graphs())
        self._prefill_fn = self._compile(self._prefill_step, compiled)
        self._decode_fn = self._compile(self._decode_step, compiled)
        self._sample_fn = self._compile(sample, compiled)

    @staticmethod
    def _compile(fn, compiled: bool):
        if not compiled:
            return fn
        return torch.compile(fn, backend="openxla", fullgraph=True, dynamic=False)

    def num_graphs(self) -> int:
        """Model-step graphs plus sampler graphs compiled at warm-up."""
        cfg = self.config
        model = len(cfg.prefill_buckets) + len(cfg.decode_batch_buckets) * len(cfg.decode_context_blocks)
        return model + len(self._sampler_variants())

    def _sampler_variants(self) -> List[Tuple[int, int, bool]]:
        batches = sorted(set(self.config.decode_batch_buckets) | {1})
        logprob_options = sorted({0, self.config.compile.max_logprobs})
        return [(b, n, g) for b in batches for n in logprob_options for g in (True, False)]

    def _prefill_step(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                      logits_indices, kv_caches):
        meta = AttentionMetadata(True, positions, slot_mapping, block_tables, context_lens)
        hidden = self.model(input_ids, kv_caches, meta)
        return self.model.compute_logits(hidden[logits_indices])

    def _decode_step(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                     logits_indices, kv_caches):
        meta = AttentionMetadata(False, positions, slot_mapping, block_tables, context_lens)
        hidden = self.model(input_ids, kv_caches, meta)
        return self.model.compute_logits(hidden[logits_indices])

    @torch.no_grad()
    def execute(self, scheduled: SchedulerOutput) -> Dict[str, SampledToken]:
        """Run every prefill, then the decode batch; sample one token for each."""
        results: Dict[str, SampledToken] = {}
        for work in scheduled.prefills:
            bucket = pick_bucket(self.config.prefill_buckets, work.start_pos + len(work.token_ids))
            inputs = prefill_inputs(work, bucket, self.block_size).to(self.device)
            with self.guard.watch(f"prefill bucket {bucket}"):
                logits = self._prefill_fn(*inputs.as_args(), self.kv_caches)
                results.update(self._sample([work], logits, batch=1))
        if scheduled.decodes:
            results.update(self._run_decode(scheduled.decodes))
        return results

    def _run_decode(self, work: Sequence[DecodeWork]) -> Dict[str, SampledToken]:
        batch = pick_bucket(self.config.decode_batch_buckets, len(work))
        needed = max(item.position // self.block_size + 1 for item in work)
        width = pick_bucket(self.config.decode_context_blocks, needed)
        inputs = decode_inputs(work, batch, width, self.block_size).to(self.device)
        with self.guard.watch(f"decode bucket batch={batch} blocks={width}"):
            logits = self._decode_fn(*inputs.as_args(), self.kv_caches)
            return self._sample(work, logits, batch)

    def _sample(self, work, logits: torch.Tensor, batch: int) -> Dict[str, SampledToken]:
        metas = [item.sampling for item in work]
        wants_logprobs = any(m.num_logprobs > 0 for m in metas)
        num_logprobs = self.config.compile.max_logprobs if wants_logprobs else 0
        all_greedy = all(m.temperature == 0 for m in metas)
        tensors = {k: v.to(self.device) for k, v in sampling_tensors(metas, batch).items()}
        out = self._sample_fn(logits, **tensors, num_logprobs=num_logprobs, all_greedy=all_greedy)
        return _to_host(work, out)

    @torch.no_grad()
    def warmup(self, show_progress: bool = True) -> None:
        """Compile every bucket of the model step and the sampler, with a progress bar."""
        self.guard.begin_warmup()
        cfg = self.config
        progress = tqdm(total=self.num_graphs(), desc="compiling buckets", disable=not show_progress)
        for bucket in cfg.prefill_buckets:
            dummy = PrefillWork("warmup", (0,), 0, (NULL_BLOCK,), _GREEDY)
            inputs = prefill_inputs(dummy, bucket, self.block_size).to(self.device)
            self._prefill_fn(*inputs.as_args(), self.kv_caches).cpu()
            progress.update()
        for batch in cfg.decode_batch_buckets:
            for width in cfg.decode_context_blocks:
                dummy = [DecodeWork("warmup", 0, 0, (NULL_BLOCK,), _GREEDY)]
                inputs = decode_inputs(dummy, batch, width, self.block_size).to(self.device)
                self._decode_fn(*inputs.as_args(), self.kv_caches).cpu()
                progress.update()
        vocab = self.model.config.vocab_size
        for batch, num_logprobs, all_greedy in self._sampler_variants():
            logits = torch.zeros(batch, vocab).to(self.device)  # device data, as in serving
            tensors = {k: v.to(self.device) for k, v in sampling_tensors([], batch).items()}
            self._sample_fn(logits, **tensors, num_logprobs=num_logprobs, all_greedy=all_greedy).token_ids.cpu()
            progress.update()
        progress.close()
        self.guard.end_warmup()


def _to_host(work, out: SamplerOutput) -> Dict[str, SampledToken]:
    token_ids = out.token_ids.cpu().tolist()
    logprobs = out.token_logprobs.cpu().tolist()
    top_ids = out.top_ids.cpu().tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.cpu().tolist() if out.top_logprobs is not None else None
    results = {}
    for row, item in enumerate(work):
        wanted = item.sampling.num_logprobs
        top = None
        if wanted >= 0:  # -1: the request asked for no log-probs
            top = dict(zip(top_ids[row][:wanted], top_lps[row][:wanted])) if wanted and top_ids else {}
        results[item.request_id] = SampledToken(token_ids[row], logprobs[row], top)
    return results


def _raise_dynamo_limits(num_graphs: int) -> None:
    """Let dynamo keep one cache entry per bucket (its default of 8 would fall back to eager)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * num_graphs)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 16 * num_graphs)
