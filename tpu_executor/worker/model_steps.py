"""The model's step functions over one model, as the model runner compiles and calls them: a
prefill pack, a decode batch, and (eager devices) both in one call, or a verify pack in one
call. A benchmark swaps in steps without a model (``bench host``) through
``ModelRunner.model_steps_class``."""
from __future__ import annotations

from typing import Tuple

import torch

from tpu_executor.models.layers.attention import AttentionMetadata, DecodeMetadata, HiddenTaps, PrefillMetadata
from tpu_executor.worker.token_feed import fed_input_ids
from tpu_executor.worker.verify import verify_step


class ModelSteps:
    """Each step takes the call's device inputs by name and the KV caches it writes in place.
    With ``tap_layers`` set (an EAGLE-3 head's target layers), every step also takes
    ``tap_rows`` and ``tap_buffers``: where the inputs of those layers are copied
    (``HiddenTaps``)."""

    def __init__(self, model: torch.nn.Module, tap_layers: Tuple[int, ...] = ()):
        self.model = model
        self.tap_layers = tap_layers

    def _meta(self, positions, slot_mapping, tap_rows, tap_buffers, lora_slots=None, **parts) -> AttentionMetadata:
        taps = HiddenTaps(self.tap_layers, tap_buffers, tap_rows) if tap_rows is not None else None
        return AttentionMetadata(positions, slot_mapping, taps=taps, lora_slots=lora_slots, **parts)

    def prefill(self, input_ids, positions, slot_mapping, context_slots, key_positions,
                key_segments, query_segments, logits_indices, kv_caches, tap_rows=None, tap_buffers=None,
                lora_slots=None):
        """The logits of each packed prompt's last token, and the pack's hidden states."""
        prefill = PrefillMetadata(context_slots, key_positions, key_segments, query_segments)
        hidden = self.model(input_ids, kv_caches, self._meta(positions, slot_mapping, tap_rows, tap_buffers,
                                                             lora_slots, prefill=prefill))
        # The hidden states stay on the device for prompt log-probs (read only when asked for).
        return self.model.compute_logits(hidden[logits_indices]), hidden

    def verify(self, input_ids, positions, slot_mapping, context_slots, key_positions, key_segments,
               query_segments, logits_indices, rows, kv_caches, tap_rows=None, tap_buffers=None, lora_slots=None,
               **sampling):
        """A verify pack in one call (eager, at exact sizes; the bucketed paths run verify
        graphs, ``decode``): the target's token at each of ``rows``."""
        del logits_indices  # every position of the pack is read through ``rows``
        prefill = PrefillMetadata(context_slots, key_positions, key_segments, query_segments)
        hidden = self.model(input_ids, kv_caches, self._meta(positions, slot_mapping, tap_rows, tap_buffers,
                                                             lora_slots, prefill=prefill))
        return verify_step(self.model, hidden, rows, **sampling)

    def decode(self, input_ids, feed_slots, feed_tokens, positions, slot_mapping, block_tables,
               context_lens, kv_caches, tap_rows=None, tap_buffers=None, sample_rows=None, lora_slots=None):
        """The logits of each decode row; a row's token may come from the token feed. A verify
        graph (several tokens a sequence) returns the logits of its ``sample_rows``."""
        decode = DecodeMetadata(block_tables, context_lens)
        input_ids = fed_input_ids(input_ids, feed_slots, feed_tokens)
        hidden = self.model(input_ids, kv_caches, self._meta(positions, slot_mapping, tap_rows, tap_buffers,
                                                             lora_slots, decode=decode))
        return self.model.compute_logits(hidden if sample_rows is None else hidden.index_select(0, sample_rows))

    def mixed(self, input_ids, positions, slot_mapping, context_slots, key_positions, key_segments,
              query_segments, logits_indices, feed_slots, block_tables, context_lens, feed_tokens, kv_caches,
              tap_rows=None, tap_buffers=None, lora_slots=None):
        """A prefill pack's tokens, then the decode rows' (eager only): the prefill rows' logits,
        the decode rows' logits, and the pack's hidden states (for prompt log-probs)."""
        num_prefill, num_decode = query_segments.shape[0], feed_slots.shape[0]
        decode_ids = fed_input_ids(input_ids[num_prefill:], feed_slots, feed_tokens)
        meta = self._meta(positions, slot_mapping, tap_rows, tap_buffers, lora_slots,
                          decode=DecodeMetadata(block_tables, context_lens),
                          prefill=PrefillMetadata(context_slots, key_positions, key_segments, query_segments))
        hidden = self.model(torch.cat([input_ids[:num_prefill], decode_ids]), kv_caches, meta)
        logits = self.model.compute_logits(torch.cat([hidden[logits_indices], hidden[num_prefill:]]))
        return logits[:-num_decode], logits[-num_decode:], hidden[:num_prefill]
