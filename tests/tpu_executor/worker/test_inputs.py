"""Input building: the numpy block tables and slots equal a row-by-row construction."""
import random

import pytest
import torch

from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PENDING_TOKEN, DecodeWork, SamplingMeta
from tpu_executor.worker.inputs import decode_inputs, sampling_tensors
from tpu_executor.worker.token_feed import NO_FEED, TokenFeed, fed_input_ids, write_slots


def test_decode_inputs_match_row_by_row_tables_and_slots():
    rng, block_size, rows, width = random.Random(0), 16, 12, 9
    work = []
    for i in range(7):
        position = rng.randrange(0, width * block_size)
        blocks = tuple(rng.sample(range(1, 500), position // block_size + 1))
        work.append(DecodeWork(f"r{i}", rng.randrange(100), position, blocks, SamplingMeta.greedy()))
    t = decode_inputs(work, rows, width, block_size)
    for row in range(rows):
        item = work[row] if row < len(work) else None
        blocks = list(item.block_ids) if item else []
        assert t["block_tables"][row].tolist() == blocks + [NULL_BLOCK] * (width - len(blocks))
        if item:
            slot = item.block_ids[item.position // block_size] * block_size + item.position % block_size
            assert (t["input_ids"][row], t["positions"][row], t["slot_mapping"][row]) == (item.token_id, item.position, slot)
            assert t["context_lens"][row] == item.position + 1
        else:
            assert t["slot_mapping"][row] == NULL_BLOCK * block_size
    assert all(v.dtype == torch.int64 for v in t.values())


def test_sampling_tensors_pad_with_greedy_rows():
    meta = SamplingMeta(0.7, 5, 0.9, 0.1, 1234, 10, 2)  # a 10-token prompt
    t = sampling_tensors([DecodeWork("r", 7, 12, (1,), meta)], 4)  # samples position 13: output 3
    torch.testing.assert_close(t["temperature"], torch.tensor([0.7, 0, 0, 0]))
    assert t["top_k"].tolist() == [5, 0, 0, 0] and t["seeds"].tolist() == [1234, 0, 0, 0]
    assert t["steps"].tolist() == [3, 0, 0, 0] and t["top_p"].tolist()[1:] == [1.0] * 3


def test_pending_inputs_read_the_previous_steps_tokens_from_the_feed():
    meta = SamplingMeta.greedy()
    work = [DecodeWork("a", 11, 4, (1,), meta), DecodeWork("b", PENDING_TOKEN, 9, (2,), meta),
            DecodeWork("gone", PENDING_TOKEN, 3, (3,), meta)]  # its previous step failed: no token
    t = decode_inputs(work, 4, 1, 16, pending_slots={"b": 1, "other": 0})
    assert t["input_ids"].tolist() == [11, 0, 0, 0]
    assert t["feed_slots"].tolist() == [NO_FEED, 1, NO_FEED, NO_FEED]
    feed_tokens = torch.tensor([7, 42, 99])
    assert fed_input_ids(t["input_ids"], t["feed_slots"], feed_tokens).tolist() == [11, 42, 0, 0]


def test_token_feed_hands_out_fresh_slots_per_step_and_forgets_a_failed_one():
    feed = TokenFeed(max_sampled_rows=4, device=torch.device("cpu"))
    feed.begin_step()
    prefill_slots = feed.assign(["p", None], rows=3)  # a chunk that ends no prompt is not sampled
    decode_slots = feed.assign(["a", "b"], rows=4)
    assert prefill_slots.tolist() == [0, 4, 4] and decode_slots.tolist() == [1, 2, 4, 4]
    feed.written_tokens = write_slots(feed.written_tokens, decode_slots, torch.tensor([5, 6, 8, 9]))
    feed.begin_step()
    assert dict(feed.pending_slots) == {"p": 0, "a": 1, "b": 2}
    assert feed.read_tokens.tolist()[1:3] == [5, 6]
    assert feed.assign(["b"], rows=1).tolist() == [0]  # slots start over each step
    feed.forget()  # the step failed while launching: the next one finds none of its tokens
    feed.begin_step()
    assert dict(feed.pending_slots) == {}
    with pytest.raises(ValueError, match="more than 4 rows"):
        feed.assign(["a", "b", "c", "d", "e"], rows=5)
