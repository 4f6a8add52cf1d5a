"""Packed prefill attention for the native CPU path, fp32, through the C paged-attention kernel.

The model runner lays each prompt's context out as its positions 0..n-1 in page order (then
fill keys to the page's end): its keys are the first n positions of its pages. So query
``i`` of a prompt, at position ``p``, attends to the first ``p + 1`` positions of the prompt's
pages, which is a decode row of the C kernel (``paged_attention/cpu_decode.c``) with length
``p + 1`` and the prompt's block-table row, rebuilt here from the key slots. That reads the
pages in place (no gathered copy), skips the causal future instead of masking it, and shares
each K/V row among a GQA group's heads. Measured on a 2-core AVX-512 EPYC, gemma-100m heads
(8 query, 2 kv, 96 features), eight prompts of 16-256 tokens: see docs/design.md.

A layout this rebuild does not recognise (keys out of position order, a query past its
prompt's keys, a prompt in several runs) goes to ``eager.prefill_attention``, as do padding
queries (segment < 0), which see the padding keys. Without AVX-512 the C kernel's chunks of
sixteen keys spill AVX2's registers and this form ran at a fifth of ``eager_segments``' speed
(SmolLM2's heads, 2 x 256 tokens, on a 2-core AVX2 EPYC: ``tpu-executor bench cpu-kernels``),
so there it reports itself unsupported and ``eager_segments`` serves the op.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from tpu_executor.kernels.paged_attention import cpu_native
from tpu_executor.kernels.prefill_attention import eager

supported = cpu_native.wide_vectors


def supports_args(q=None, k_pages=None, v_pages=None, context_slots=None, key_positions=None, key_segments=None,
                  query_positions=None, query_segments=None, *args, **kwargs) -> bool:
    """fp32 CPU tensors, untraced (the native path)."""
    return cpu_native.fp32_cpu_operands(q, k_pages, v_pages) and \
        cpu_native.cpu_tensors(context_slots, key_positions, key_segments, query_positions, query_segments)


def prompt_tables(context_slots: torch.Tensor, key_positions: torch.Tensor, key_segments: torch.Tensor,
                  page_size: int) -> Optional[Tuple[dict, torch.Tensor, torch.Tensor]]:
    """(segment id -> table row, block tables ``[prompts, width]``, keys per prompt), or None
    when some prompt's keys are not its positions 0..n-1 at the slots of its pages."""
    spans = {s: span for s, span in eager.one_run_each(eager.segment_runs(key_segments)).items() if s >= 0}
    if not spans:
        return None
    width = max(-(-(end - start) // page_size) for start, end in spans.values())
    tables = torch.zeros(len(spans), width, dtype=torch.int64)
    key_counts = torch.zeros(len(spans), dtype=torch.int64)
    for row, (start, end) in enumerate(spans.values()):
        count = end - start
        offsets = torch.arange(count)
        slots = context_slots[start:end].to(torch.int64)
        pages = slots[::page_size] // page_size
        expected = pages.repeat_interleave(page_size)[:count] * page_size + offsets % page_size
        if not (torch.equal(key_positions[start:end].to(torch.int64), offsets) and torch.equal(slots, expected)):
            return None
        tables[row, :pages.shape[0]] = pages
        key_counts[row] = count
    return {segment: row for row, segment in enumerate(spans)}, tables, key_counts


class LastPlan:
    """The query plan of the last call's layout, while the same layout tensors come back
    unmodified (every layer of a step gets the step's metadata tensors): keyed on their
    identity and in-place version, so a reused buffer with new contents is planned anew."""

    def __init__(self):
        self._entry = (None, None, None)  # (key, the tensors, kept so their ids stay theirs; plan)

    def get(self, layout: Tuple[torch.Tensor, ...], page_size: int):
        key = tuple((id(t), t._version) for t in layout) + (page_size,)
        if self._entry[0] != key:
            self._entry = (key, layout, query_plan(*layout, page_size))
        return self._entry[2]


def query_plan(context_slots, key_positions, key_segments, query_positions, query_segments,
               page_size: int) -> Optional[Tuple[torch.Tensor, ...]]:
    """(block tables, table row and length of each real query, which queries are real), or
    None when the layout is not one the kernel can read (see the module doc)."""
    layout = prompt_tables(context_slots, key_positions, key_segments, page_size)
    if layout is None:
        return None
    row_of_segment, tables, key_counts = layout
    real = query_segments >= 0
    segments = query_segments[real].tolist()
    if any(segment not in row_of_segment for segment in segments):
        return None
    rows = torch.tensor([row_of_segment[segment] for segment in segments], dtype=torch.int64)
    lens = query_positions[real].to(torch.int64) + 1
    if bool((lens > key_counts[rows]).any()):  # a query past its prompt's keys
        return None
    return tables, rows, lens, real


PLANS = LastPlan()


def prefill_attention(q, k_pages, v_pages, context_slots, key_positions, key_segments,
                      query_positions, query_segments, *, scale, soft_cap=None, sliding_window=None):
    """Same contract as ``reference.prefill_attention`` (fp32 CPU tensors)."""
    layout = (context_slots, key_positions, key_segments, query_positions, query_segments)
    options = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    plan = PLANS.get(layout, k_pages.shape[2])
    if plan is None:
        return eager.prefill_attention(q, k_pages, v_pages, *layout, **options)
    tables, rows, lens, real = plan
    if rows.shape[0] == q.shape[0]:
        return cpu_native.attend(q, k_pages, v_pages, lens, tables, rows, **options)
    out = torch.empty_like(q)
    out[real] = cpu_native.attend(q[real], k_pages, v_pages, lens, tables, rows, **options)
    padding = ~real
    out[padding] = eager.prefill_attention(q[padding], k_pages, v_pages, context_slots, key_positions, key_segments,
                                           query_positions[padding], query_segments[padding], **options)
    return out
