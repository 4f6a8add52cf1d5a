"""Logits processing: the device functions (eager here) against the one-row reference on random
requests, with the state built as the engine builds it (a slot filled from a history, then the
sampled tokens recorded one by one); and the slots' bookkeeping."""
from __future__ import annotations

import random

import torch

from tpu_executor.core.request import logits_processing
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.worker.logits_processing import (
    ProcessingRows,
    ProcessingSlots,
    fill_slots,
    fill_tensors,
    process_logits,
    process_logits_reference,
    record_tokens,
)

VOCAB = 48
WORDS = (VOCAB + 31) // 32


def random_params(rng: random.Random) -> SamplingParams:
    tokens = lambda k: rng.sample(range(VOCAB), k)  # noqa: E731
    return SamplingParams(
        max_tokens=30, presence_penalty=rng.choice([0.0, 0.7, -1.2]), frequency_penalty=rng.choice([0.0, 0.4]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]), min_tokens=rng.choice([0, 3, 8]),
        logit_bias={t: rng.uniform(-100, 100) for t in tokens(rng.randint(0, 5))},
        allowed_token_ids=tokens(rng.randint(3, 12)) if rng.random() < 0.3 else None)


def random_bad_words(rng: random.Random):
    return tuple(tuple(rng.sample(range(VOCAB), rng.randint(1, 4))) for _ in range(rng.randint(0, 4)))


def test_device_processing_equals_the_reference_row_by_row():
    rng = random.Random(0)
    rows, discard = 6, 8
    for case in range(20):
        slots = ProcessingSlots(discard, VOCAB, torch.device("cpu"))
        params = [random_params(rng) for _ in range(rows)]
        processings = [logits_processing(p, frozenset({2, 5}), random_bad_words(rng)) for p in params]
        prompts = [rng.choices(range(VOCAB), k=rng.randint(1, 20)) for _ in range(rows)]
        outputs = [rng.choices(range(VOCAB), k=rng.randint(0, 12)) for _ in range(rows)]
        # Each slot starts from the history up to some point, and records the rest as sampled.
        cut = [rng.randint(0, len(o)) for o in outputs]
        fills = [(row, tuple(p + o[:c]), len(p)) for row, (p, o, c) in enumerate(zip(prompts, outputs, cut))]
        fill_slots(*slots.state, **fill_tensors(fills, rows, 64, discard))
        for step in range(max(len(o) - c for o, c in zip(outputs, cut))):
            sampled = [o[c + step] if c + step < len(o) else 0 for o, c in zip(outputs, cut)]
            state_slots = [row if cut[row] + step < len(outputs[row]) else discard for row in range(rows)]
            record_tokens(slots.counts, slots.recent, torch.tensor(state_slots), torch.tensor(sampled))
        arrays = {name: torch.stack([torch.as_tensor(slots_row_arrays(p)[name]) for p in processings])
                  for name in ("penalties", "entry_ids", "entry_values", "entry_kinds", "min_tokens", "bad_prefixes",
                               "bad_last")}
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(case)) * 3
        steps = torch.tensor([len(o) for o in outputs])
        # Some rows follow a grammar: a random bitmask (bits past the vocabulary set too).
        bitmasks = [[rng.randrange(-2**31, 2**31) for _ in range(WORDS)] if rng.random() < 0.5 else None
                    for _ in range(rows)]
        arrays["token_bitmask"] = torch.tensor([b or [-1] * WORDS for b in bitmasks], dtype=torch.int32)
        processed = process_logits(logits, *slots.state, ProcessingRows(state_slots=torch.arange(rows), **arrays),
                                   steps=steps)
        for row in range(rows):
            expected = process_logits_reference(logits[row], processings[row], prompts[row], outputs[row],
                                                bitmasks[row])
            torch.testing.assert_close(processed[row], expected, rtol=1e-6, atol=1e-6)


def slots_row_arrays(processing):
    from tpu_executor.worker.logits_processing import row_arrays

    return row_arrays(processing)


def test_slots_are_given_on_a_history_and_freed_with_the_request():
    slots = ProcessingSlots(2, VOCAB, torch.device("cpu"))
    processing = logits_processing(SamplingParams(presence_penalty=1.0), frozenset(), ())

    class Work:  # what the runner hands over: a request, its sampling row, maybe a history
        def __init__(self, request_id, history=None):
            self.request_id, self.history = request_id, history
            self.sampling = type("Meta", (), {"processing": processing, "prompt_len": 1})()

    _, fills = slots.prepare([Work("a", (3, 4)), Work("b", (5,))], rows=4)
    assert sorted(slot for slot, _, _ in fills) == [0, 1]
    slots.begin_step(["b"])  # "a" finished or was preempted: its slot is free again
    rows, fills = slots.prepare([Work("b"), Work("c", (6,))], rows=4)
    assert fills and rows.state_slots.tolist()[2:] == [2, 2]  # padding rows use the discard slot
    assert slots.prepare([Work("z")], rows=2) is None  # no history, no slot: nothing to process
