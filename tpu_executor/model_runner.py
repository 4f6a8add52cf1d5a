"""Model runner: host-side input preparation, bucket padding, compiled model step and sampler.

A prefill call packs up to ``max_prefill_seqs`` prompts into one row padded to a prefill
bucket; a decode runs a batch padded to a (batch, context-blocks) bucket. Model step and sampler are separately compiled functions, so
their graph counts add instead of multiplying. On the native path (device "cpu") the same code
runs eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from tqdm import tqdm

from models.layers.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata
from tpu_executor.compilation import CompileGuard, pick_bucket
from tpu_executor.config import EngineConfig
from tpu_executor.kv_cache_manager import NULL_BLOCK
from tpu_executor.sampler import SamplerOutput, sample
from tpu_executor.scheduler import DecodeWork, PrefillWork, SampledToken, SamplingMeta, SchedulerOutput

logger = logging.getLogger(__name__)

_GREEDY = SamplingMeta(0.0, 0, 1.0, 0.0, 0, 0, -1)


@dataclass
class PaddingStats:
    """Real versus padded work, to judge the buckets: prefill tokens and decode rows."""

    prefill_real: int = 0
    prefill_padded: int = 0
    decode_rows_real: int = 0
    decode_rows_padded: int = 0

    def waste(self) -> Dict[str, float]:
        def frac(real, padded):
            return 1.0 - real / padded if padded else 0.0
        return {"prefill": frac(self.prefill_real, self.prefill_padded),
                "decode_rows": frac(self.decode_rows_real, self.decode_rows_padded)}


def pack_prefills(work: Sequence[PrefillWork], max_tokens: int, max_seqs: int) -> List[List[PrefillWork]]:
    """Group prefills, in order, into packs of at most ``max_seqs`` sequences whose contexts
    (cached + new tokens) add up to at most ``max_tokens``."""
    packs: List[List[PrefillWork]] = []
    used = max_tokens + 1
    for item in work:
        size = item.start_pos + len(item.token_ids)
        if used + size > max_tokens or len(packs[-1]) == max_seqs:
            packs.append([])
            used = 0
        packs[-1].append(item)
        used += size
    return packs


def _slots(block_ids: Sequence[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def prefill_inputs(pack: Sequence[PrefillWork], bucket: int, max_seqs: int, block_size: int) -> Dict[str, torch.Tensor]:
    """Several sequences' new tokens packed into one ``bucket``-long row, with their contexts
    (prefix-cached and new) as the keys. Padding queries and keys share segment -1."""
    t = {name: torch.zeros(bucket, dtype=torch.int64) for name in
         ("input_ids", "positions", "slot_mapping", "context_slots", "key_positions")}
    t["query_segments"] = torch.full((bucket,), -1, dtype=torch.int64)
    t["key_segments"] = torch.full((bucket,), -1, dtype=torch.int64)
    t["logits_indices"] = torch.zeros(max_seqs, dtype=torch.int64)
    query_at = key_at = 0
    for segment, item in enumerate(pack):
        num_new, num_ctx = len(item.token_ids), item.start_pos + len(item.token_ids)
        q, k = slice(query_at, query_at + num_new), slice(key_at, key_at + num_ctx)
        t["input_ids"][q] = torch.tensor(item.token_ids, dtype=torch.int64)
        t["positions"][q] = torch.arange(item.start_pos, num_ctx)
        t["slot_mapping"][q] = _slots(item.block_ids, t["positions"][q], block_size)
        t["query_segments"][q] = segment
        t["key_positions"][k] = torch.arange(num_ctx)
        t["context_slots"][k] = _slots(item.block_ids, t["key_positions"][k], block_size)
        t["key_segments"][k] = segment
        t["logits_indices"][segment] = query_at + num_new - 1
        query_at, key_at = query_at + num_new, key_at + num_ctx
    return t


def decode_inputs(work: Sequence[DecodeWork], batch: int, width: int, block_size: int) -> Dict[str, torch.Tensor]:
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
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots,
            "block_tables": tables, "context_lens": positions + 1}


def _to(tensors: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in tensors.items()}


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
        self.padding = PaddingStats()
        self.max_prefill_seqs = config.compile.max_prefill_seqs
        compiled = device.type == "xla"
        if compiled:
            _raise_dynamo_limits(self.num_graphs())
        # Host-side collectives (gloo on CPU) split the model step into one graph per piece
        # between collectives; each piece is still compiled once per bucket.
        one_graph = model.tp.collectives_in_graph
        self._prefill_fn = self._compile(self._prefill_step, compiled, one_graph)
        self._decode_fn = self._compile(self._decode_step, compiled, one_graph)
        self._sample_fn = self._compile(sample, compiled, True)

    @staticmethod
    def _compile(fn, compiled: bool, fullgraph: bool):
        if not compiled:
            return fn
        return torch.compile(fn, backend="openxla", fullgraph=fullgraph, dynamic=False)

    def num_graphs(self) -> int:
        """Model-step graphs plus sampler graphs compiled at warm-up."""
        cfg = self.config
        model = len(cfg.prefill_buckets) + len(cfg.decode_batch_buckets) * len(cfg.decode_context_blocks)
        return model + len(self._sampler_variants())

    def _sampler_variants(self) -> List[Tuple[int, int, bool]]:
        batches = sorted(set(self.config.decode_batch_buckets) | {self.max_prefill_seqs})
        logprob_options = sorted({0, self.config.compile.max_logprobs})
        return [(b, n, g) for b in batches for n in logprob_options for g in (True, False)]

    def _prefill_step(self, input_ids, positions, slot_mapping, context_slots, key_positions,
                      key_segments, query_segments, logits_indices, kv_caches):
        prefill = PrefillMetadata(context_slots, key_positions, key_segments, query_segments)
        hidden = self.model(input_ids, kv_caches, AttentionMetadata(positions, slot_mapping, prefill=prefill))
        return self.model.compute_logits(hidden[logits_indices])

    def _decode_step(self, input_ids, positions, slot_mapping, block_tables, context_lens, kv_caches):
        decode = DecodeMetadata(block_tables, context_lens)
        hidden = self.model(input_ids, kv_caches, AttentionMetadata(positions, slot_mapping, decode=decode))
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def execute(self, scheduled: SchedulerOutput) -> Dict[str, SampledToken]:
        """Run the prefills (packed), then the decode batch; sample one token for each."""
        results: Dict[str, SampledToken] = {}
        buckets = self.config.prefill_buckets
        for pack in pack_prefills(scheduled.prefills, buckets[-1], self.max_prefill_seqs):
            results.update(self._run_prefill(pack))
        if scheduled.decodes:
            results.update(self._run_decode(scheduled.decodes))
        return results

    def _run_prefill(self, pack: Sequence[PrefillWork]) -> Dict[str, SampledToken]:
        bucket = pick_bucket(self.config.prefill_buckets, sum(w.start_pos + len(w.token_ids) for w in pack))
        inputs = _to(prefill_inputs(pack, bucket, self.max_prefill_seqs, self.block_size), self.device)
        self.padding.prefill_real += sum(len(w.token_ids) for w in pack)
        self.padding.prefill_padded += bucket
        with self.guard.watch(f"prefill bucket {bucket}"):
            logits = self._prefill_fn(**inputs, kv_caches=self.kv_caches)
            return self._sample(pack, logits, self.max_prefill_seqs)

    def _run_decode(self, work: Sequence[DecodeWork]) -> Dict[str, SampledToken]:
        batch = pick_bucket(self.config.decode_batch_buckets, len(work))
        needed = max(item.position // self.block_size + 1 for item in work)
        width = pick_bucket(self.config.decode_context_blocks, needed)
        inputs = _to(decode_inputs(work, batch, width, self.block_size), self.device)
        self.padding.decode_rows_real += len(work)
        self.padding.decode_rows_padded += batch
        with self.guard.watch(f"decode bucket batch={batch} blocks={width}"):
            logits = self._decode_fn(**inputs, kv_caches=self.kv_caches)
            return self._sample(work, logits, batch)

    def _sample(self, work, logits: torch.Tensor, batch: int) -> Dict[str, SampledToken]:
        metas = [item.sampling for item in work]
        wants_logprobs = any(m.num_logprobs > 0 for m in metas)
        num_logprobs = self.config.compile.max_logprobs if wants_logprobs else 0
        all_greedy = all(m.temperature == 0 for m in metas)
        tensors = _to(sampling_tensors(metas, batch), self.device)
        out = self._sample_fn(logits, **tensors, num_logprobs=num_logprobs, all_greedy=all_greedy)
        return _to_host(work, out)

    @torch.no_grad()
    def warmup(self, show_progress: bool = True) -> None:
        """Compile every bucket of the model step and the sampler, with a progress bar."""
        self.guard.begin_warmup()
        cfg = self.config
        progress = tqdm(total=self.num_graphs(), desc="compiling buckets", disable=not show_progress)
        for bucket in cfg.prefill_buckets:
            dummy = [PrefillWork("warmup", (0,), 0, (NULL_BLOCK,), _GREEDY)]
            inputs = _to(prefill_inputs(dummy, bucket, self.max_prefill_seqs, self.block_size), self.device)
            self._prefill_fn(**inputs, kv_caches=self.kv_caches).cpu()
            progress.update()
        for batch in cfg.decode_batch_buckets:
            for width in cfg.decode_context_blocks:
                dummy = [DecodeWork("warmup", 0, 0, (NULL_BLOCK,), _GREEDY)]
                inputs = _to(decode_inputs(dummy, batch, width, self.block_size), self.device)
                self._decode_fn(**inputs, kv_caches=self.kv_caches).cpu()
                progress.update()
        vocab = self.model.config.vocab_size
        for batch, num_logprobs, all_greedy in self._sampler_variants():
            logits = torch.zeros(batch, vocab).to(self.device)  # device data, as in serving
            tensors = _to(sampling_tensors([], batch), self.device)
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
