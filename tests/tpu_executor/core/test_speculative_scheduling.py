"""Scheduling draft tokens with a fake model and a drafter that is right only some of the time:
the tokens are those of decoding one at a time, the token budget holds, rejected drafts' blocks
come back, and the counts add up, through preemption and chunked prefill."""
import random

import pytest

from tests.tpu_executor.core.test_scheduler import expected_outputs, make_request, make_scheduler
from tpu_executor.core.request import RequestStatus
from tpu_executor.core.speculative import SpecCounts
from tpu_executor.core.step import SampledTokens


def model_token(tokens):
    """The fake model of test_scheduler.py: the next token depends on everything before it."""
    return (sum(tokens) * 31 + len(tokens)) % 97


class HalfRightDrafter:
    """Drafts the model's true next tokens, with one of them wrong now and then."""

    drafts_in_worker = False

    def __init__(self, seed: int, limit: int = 100):
        self.rng, self.limit = random.Random(seed), limit

    def active(self, num_running):
        return num_running <= self.limit

    def propose(self, request, max_drafts):
        tokens, drafts = list(request.all_token_ids), []
        for _ in range(self.rng.randint(0, max_drafts)):
            token = model_token(tokens)
            if self.rng.random() < 0.2:
                token = (token + 1) % 97
            drafts.append(token)
            tokens.append(token)
        return tuple(drafts)


def verified_rows(work, table):
    """What the verifier gives for a verify: accepted drafts, then the model's own token."""
    tokens, rows = list(table[work.request_id].all_token_ids), []
    for draft in work.token_ids[1:] + (None,):
        token = model_token(tokens)
        rows.append(token)
        if draft != token:
            break
        tokens.append(token)
    return rows


def step_tokens(out, table):
    ids, tokens = [], []
    for work in out.prefills + out.decodes:
        if getattr(work, "is_last_chunk", True):
            ids.append(work.request_id)
            tokens.append(model_token(table[work.request_id].all_token_ids))
    for work in out.verifies:
        rows = verified_rows(work, table)
        ids += [work.request_id] * len(rows)
        tokens += rows
    return SampledTokens(ids, tokens, [0.0] * len(ids))


@pytest.mark.parametrize("budget, num_blocks", [(64, 200), (64, 16), (10, 16)])
def test_drafted_tokens_are_those_of_one_at_a_time(budget, num_blocks):
    rng = random.Random(budget + num_blocks)
    specs = [(rng.randint(3, 20), rng.randint(1, 30)) for _ in range(12)]
    scheduler, kv = make_scheduler(num_blocks=num_blocks, max_num_seqs=6, max_tokens_per_step=budget)
    scheduler.drafter = HalfRightDrafter(seed=budget)
    requests = [make_request(str(i), p, m) for i, (p, m) in enumerate(specs)]
    table = {r.request_id: r for r in requests}
    for r in requests:
        scheduler.add(r)
    verified = drafted = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        computed = sum(len(w.token_ids) for w in out.prefills + out.verifies) + len(out.decodes)
        assert computed <= budget
        for work in out.verifies:
            request = table[work.request_id]
            assert work.start_pos == request.num_tokens - 1 and work.token_ids[0] == request.all_token_ids[-1]
            # blocks for every draft, and the outputs never overshoot max_tokens
            assert len(work.block_ids) * 4 >= work.start_pos + len(work.token_ids)
            assert len(request.output_token_ids) + len(work.token_ids) <= request.max_outputs
        verified += len(out.verifies)
        drafted += sum(len(w.token_ids) - 1 for w in out.verifies)
        _, finished = scheduler.update(step_tokens(out, table), table)
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in finished)
        for request in scheduler.running:  # rejected drafts' blocks came back
            assert len(kv.block_ids(request.request_id)) <= kv.blocks_needed(request.num_tokens)
        kv.check_invariants()
    assert verified > 0
    for request, (p, m) in zip(requests, specs):
        assert request.output_token_ids == expected_outputs(p, m)
    assert kv.num_free_blocks == kv.num_usable_blocks
    counts = scheduler.spec
    assert counts.num_drafts == verified and counts.num_draft_tokens == drafted
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    if num_blocks == 16:
        assert sum(r.num_preemptions for r in requests) > 0, "the test must exercise preemption"


def test_no_drafts_above_the_batch_limit():
    scheduler, kv = make_scheduler(num_blocks=200, max_num_seqs=6)
    scheduler.drafter = HalfRightDrafter(seed=0, limit=2)
    requests = [make_request(str(i), 8, 20, first=i * 10 + 1) for i in range(3)]
    table = {r.request_id: r for r in requests}
    for r in requests:
        scheduler.add(r)
    scheduler.update(step_tokens(scheduler.schedule(), table), table)  # the prompts
    assert not scheduler.schedule().verifies  # 3 running: over the limit of 2


def test_spec_counts_per_position():
    counts = SpecCounts()
    counts.add(4, 2)
    counts.add(4, 0)
    counts.add(3, 3)
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (3, 11, 5)
    assert counts.accepted_per_position == [2, 2, 1]
    assert counts.mean_accepted_length == pytest.approx(1 + 5 / 3)


def test_a_request_whose_drafts_keep_failing_drafts_less_often():
    """After a verify that accepts nothing, a request decodes 1, 3, 7, 15, then 16 steps before
    it drafts again; an accepted draft ends the wait."""
    class LateDrafter:
        """Wrong until the request has 20 outputs, right after (drafted in the worker, as a
        draft model's: the scheduler names the requests to draft for)."""

        drafts_in_worker = True

        def active(self, num_running):
            return True

        def propose(self, request, max_drafts):
            right = model_token(request.all_token_ids)
            return (right if len(request.output_token_ids) >= 20 else (right + 1) % 97,)

    scheduler, kv = make_scheduler(num_blocks=200)
    scheduler.drafter = LateDrafter()
    request = make_request("r", 8, 60)
    table = {"r": request}
    scheduler.add(request)
    verify_steps, drafting_steps = [], []
    for step in range(40):
        out = scheduler.schedule()
        if out.verifies:
            verify_steps.append(step)
        if "r" in out.drafting:
            drafting_steps.append(step)
        scheduler.update(step_tokens(out, table), table)
    # step 0 is the prompt; misses at 1, 3, 7, 15 (waits of 1, 3, 7); the verify at step 31
    # (after a wait of 15) holds, and from then on the request verifies every step
    assert verify_steps == [1, 3, 7, 15, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    # A draft model drafts after the steps before a verify, and after a verify (its outcome
    # decides the wait): not while the request waits out its misses.
    assert drafting_steps == sorted({s - 1 for s in verify_steps} | set(verify_steps))
