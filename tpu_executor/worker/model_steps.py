"""The model's step functions over one model, as the model runner compiles and calls them: a
prefill pack, a decode batch, and (eager devices) both in one call, or a verify pack in one
call. A benchmark swaps in steps without a model (``bench host``) through
``ModelRunner.model_steps_class``."""
from __future__ import annotations

import torch

from tpu_executor.models.layers.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata
from tpu_executor.worker.token_feed import fed_input_ids
from tpu_executor.worker.verify import verify_step


class ModelSteps:
    """Each step takes the call's device inputs by name and the KV caches it writes in place."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def prefill(self, input_ids, positions, slot_mapping, context_slots, key_positions,
                key_segments, query_segments, logits_indices, kv_caches):
        """The logits of each packed prompt's last token, and the pack's hidden states."""
        hidden = self._packed_hidden(input_ids, positions, slot_mapping, context_slots, key_positions,
                                     key_segments, query_segments, kv_caches)
        # The hidden states stay on the device for prompt log-probs (read only when asked for).
        return self.model.compute_logits(hidden[logits_indices]), hidden

    def verify(self, input_ids, positions, slot_mapping, context_slots, key_positions, key_segments,
               query_segments, logits_indices, rows, kv_caches, **sampling):
        """A verify pack in one call (eager, at exact sizes; the bucketed paths run verifies as
        decode rows): the target's token at each of ``rows``."""
        del logits_indices  # every position of the pack is read through ``rows``
        hidden = self._packed_hidden(input_ids, positions, slot_mapping, context_slots, key_positions,
                                     key_segments, query_segments, kv_caches)
        return verify_step(self.model, hidden, rows, **sampling)

    def _packed_hidden(self, input_ids, positions, slot_mapping, context_slots, key_positions, key_segments,
                       query_segments, kv_caches):
        """The model over a packed prefill row: its hidden states."""
        prefill = PrefillMetadata(context_slots, key_positions, key_segments, query_segments)
        return self.model(input_ids, kv_caches, AttentionMetadata(positions, slot_mapping, prefill=prefill))

    def decode(self, input_ids, feed_slots, feed_tokens, positions, slot_mapping, block_tables,
               context_lens, kv_caches):
        """The logits of each decode row; a row's token may come from the token feed."""
        decode = DecodeMetadata(block_tables, context_lens)
        input_ids = fed_input_ids(input_ids, feed_slots, feed_tokens)
        hidden = self.model(input_ids, kv_caches, AttentionMetadata(positions, slot_mapping, decode=decode))
        return self.model.compute_logits(hidden)

    def mixed(self, input_ids, positions, slot_mapping, context_slots, key_positions, key_segments,
              query_segments, logits_indices, feed_slots, block_tables, context_lens, feed_tokens, kv_caches):
        """A prefill pack's tokens, then the decode rows' (eager only): the prefill rows' logits,
        the decode rows' logits, and the pack's hidden states (for prompt log-probs)."""
        num_prefill, num_decode = query_segments.shape[0], feed_slots.shape[0]
        decode_ids = fed_input_ids(input_ids[num_prefill:], feed_slots, feed_tokens)
        meta = AttentionMetadata(positions, slot_mapping, decode=DecodeMetadata(block_tables, context_lens),
                                 prefill=PrefillMetadata(context_slots, key_positions, key_segments, query_segments))
        hidden = self.model(torch.cat([input_ids[:num_prefill], decode_ids]), kv_caches, meta)
        logits = self.model.compute_logits(torch.cat([hidden[logits_indices], hidden[num_prefill:]]))
        return logits[:-num_decode], logits[-num_decode:], hidden[:num_prefill]
