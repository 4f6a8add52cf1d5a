"""Input building: the persistent decode batch's tables, slots and sampling columns equal a
row-by-row construction over a run of steps; the prefill sampler columns pad with greedy rows;
pending tokens come from the token feed."""
import pickle
import random

import pytest
import torch

from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PENDING_TOKEN, DecodeWork, SamplingMeta
from tpu_executor.worker.decode_batch import PersistentDecodeBatch
from tpu_executor.worker.inputs import sampling_tensors
from tpu_executor.worker.token_feed import NO_FEED, TokenFeed, fed_input_ids, write_slots

BLOCK_SIZE = 16


def batch_inputs(work, rows, width, max_rows=16, max_blocks=12, pending_slots=None):
    batch = PersistentDecodeBatch(max_rows, max_blocks)
    batch.update(work)
    return batch.inputs(rows, width, BLOCK_SIZE, pending_slots or {})


def assert_rows_match(t, work, rows, width):
    """Every tensor of the decode call equals what the row's work says, padding rows null."""
    for row in range(rows):
        item = work[row] if row < len(work) else None
        blocks = list(item.block_ids) if item else []
        assert t["block_tables"][row].tolist() == blocks + [NULL_BLOCK] * (width - len(blocks))
        if item:
            slot = item.block_ids[item.position // BLOCK_SIZE] * BLOCK_SIZE + item.position % BLOCK_SIZE
            laid_out = (t["input_ids"][row], t["positions"][row], t["slot_mapping"][row])
            assert laid_out == (item.token_id, item.position, slot)
            assert t["context_lens"][row] == item.position + 1
        else:
            assert t["slot_mapping"][row] == NULL_BLOCK * BLOCK_SIZE and t["positions"][row] == 0
    assert all(v.dtype == torch.int64 for v in t.values())


def assert_sampling_matches(s, work, rows):
    expected = sampling_tensors(work, rows)  # the per-step construction the prefill calls use
    assert s.keys() == expected.keys()
    for name in s:
        torch.testing.assert_close(s[name], expected[name], rtol=0, atol=0)


def random_meta(rng):
    return SamplingMeta(rng.choice([0.0, 0.8]), rng.randrange(4), 1.0, 0.0, rng.randrange(1000), rng.randrange(1, 20),
                        rng.choice([-1, 0, 2]))


def test_decode_inputs_match_row_by_row_tables_and_slots():
    rng, rows, width = random.Random(0), 12, 9
    work = []
    for i in range(7):
        position = rng.randrange(0, width * BLOCK_SIZE)
        blocks = tuple(rng.sample(range(1, 500), position // BLOCK_SIZE + 1))
        work.append(DecodeWork(f"r{i}", rng.randrange(100), position, blocks, SamplingMeta.greedy()))
    assert_rows_match(batch_inputs(work, rows, width), work, rows, width)


def test_persistent_batch_follows_joins_leaves_moves_and_new_blocks_over_many_steps():
    """Each step some requests leave, some join, the order shuffles now and then, positions
    advance and tables grow a block at page boundaries; some steps carry equal but new tuples
    (as over Ray). Every step's tensors equal a fresh row-by-row construction."""
    rng, batch = random.Random(1), PersistentDecodeBatch(max_rows=16, max_blocks=12)
    live = {}  # request id -> [position, blocks tuple, meta]
    next_id = 0
    for step in range(120):
        for request_id in rng.sample(sorted(live), k=min(len(live), rng.randrange(3))):
            del live[request_id]
        while len(live) < 14 and rng.random() < 0.5:
            position = rng.randrange(0, 60)
            blocks = tuple(rng.sample(range(1, 900), position // BLOCK_SIZE + 1))
            live[f"r{next_id}"] = [position, blocks, random_meta(rng)]
            next_id += 1
        order = sorted(live, key=lambda r: int(r[1:]))
        if step % 7 == 0:
            rng.shuffle(order)
        work = []
        for request_id in order:
            state = live[request_id]
            state[0] += 1
            if state[0] // BLOCK_SIZE + 1 > len(state[1]):
                state[1] = state[1] + (rng.randrange(1, 900),)
            work.append(DecodeWork(request_id, rng.randrange(100), state[0], state[1], state[2]))
        if step % 5 == 0:
            work = pickle.loads(pickle.dumps(work))  # equal values, new objects
        rows = 16 if len(work) > 8 else 8
        width = max([len(w.block_ids) for w in work], default=1)
        batch.update(work)
        assert_rows_match(batch.inputs(rows, width, BLOCK_SIZE), work, rows, width)
        assert_sampling_matches(batch.sampling(rows), work, rows)
        assert batch.request_ids == tuple(w.request_id for w in work)
        assert batch.wants_logprobs == any(w.sampling.num_logprobs > 0 for w in work)
        assert batch.all_greedy == all(w.sampling.temperature == 0 for w in work)


def test_a_steps_tensors_are_not_changed_by_the_next_update():
    batch = PersistentDecodeBatch(max_rows=4, max_blocks=4)
    meta = SamplingMeta(0.5, 0, 1.0, 0.0, 1, 3, -1)
    batch.update([DecodeWork("a", 5, 15, (7,), meta)])
    first, first_sampling = batch.inputs(4, 2, BLOCK_SIZE), batch.sampling(4)
    batch.update([DecodeWork("b", 6, 16, (8, 9), SamplingMeta.greedy()), DecodeWork("a", 5, 16, (7, 3), meta)])
    batch.inputs(4, 2, BLOCK_SIZE), batch.sampling(4)
    assert first["block_tables"][0].tolist() == [7, NULL_BLOCK] and first["positions"][0] == 15
    torch.testing.assert_close(first_sampling["temperature"], torch.tensor([0.5, 0, 0, 0]))


def test_more_rows_than_the_largest_bucket_are_refused():
    batch = PersistentDecodeBatch(max_rows=2, max_blocks=4)
    work = [DecodeWork(f"r{i}", 1, 1, (1,), SamplingMeta.greedy()) for i in range(3)]
    with pytest.raises(ValueError, match="3 decode rows exceed the largest decode bucket"):
        batch.update(work)


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
    t = batch_inputs(work, 4, 1, pending_slots={"b": 1, "other": 0})
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


def test_a_verify_graphs_inputs_put_each_sequences_tokens_at_the_end_of_its_rows():
    """Decodes first (one token, last of its rows), then verifies (last token and drafts),
    padding rows before them writing the null block; the sampled rows in that order."""
    from tpu_executor.core.buckets import DecodeGraph
    from tpu_executor.core.step import PrefillWork
    from tpu_executor.worker.verify import verify_query_inputs

    block_size, graph = 4, DecodeGraph(4, 3, queries=3)
    batch = PersistentDecodeBatch(4, 3)
    batch.update([DecodeWork("d", 7, 5, (2, 6), SamplingMeta.greedy())])
    decodes = batch.inputs(1, 3, block_size)
    verify = PrefillWork("v", (8, 9), 4, (1, 3), SamplingMeta.greedy())  # one draft, positions 4-5
    null_slot = NULL_BLOCK * block_size
    for given, sampled in ((decodes, [2, 4, 5]), (None, [1, 2])):
        inputs = verify_query_inputs(given, [verify], graph, block_size)
        first = 0 if given is None else 1
        rows = [r + 3 * first for r in (1, 2)]
        assert inputs["input_ids"][rows].tolist() == [8, 9]
        assert inputs["positions"][rows].tolist() == [4, 5]
        assert inputs["slot_mapping"][rows].tolist() == [3 * block_size, 3 * block_size + 1]
        assert inputs["context_lens"][first].item() == 6
        assert inputs["block_tables"][first].tolist() == [1, 3, NULL_BLOCK]
        padding = [r for r in range(12) if r not in rows and (given is None or r != 2)]
        assert set(inputs["slot_mapping"][padding].tolist()) == {null_slot}
        assert inputs["sample_rows"].tolist()[:len(sampled)] == sampled
        assert inputs["context_lens"][first + 1:].tolist() == [1] * (3 - first)  # padding sequences
    inputs = verify_query_inputs(decodes, [verify], graph, block_size)
    assert inputs["input_ids"][2].item() == 7 and inputs["positions"][2].item() == 5
    assert inputs["slot_mapping"][2].item() == 6 * block_size + 1 and inputs["context_lens"][0].item() == 6
