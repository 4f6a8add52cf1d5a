"""Invariants of the paged KV-cache manager under random operation sequences (hypothesis)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_executor.core.kv_cache_manager import NULL_BLOCK, KVCacheManager

BLOCK = 4

operations = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5),
              st.lists(st.integers(0, 3), min_size=1, max_size=24)),
    max_size=60)


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(2, 24), st.booleans())
def test_accounting_never_leaks(ops, num_blocks, prefix_caching):
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    tokens = {}
    for op, rid, prompt in ops:
        rid = str(rid)
        if op == "admit" and rid not in tokens:
            cached, num_cached = kv.find_cached_prefix(prompt)
            assert num_cached < len(prompt)
            if kv.allocate(rid, len(prompt), cached):
                tokens[rid] = list(prompt)
                kv.cache_computed_blocks(rid, prompt, len(prompt))
        elif op == "grow" and rid in tokens:
            tokens[rid].append(prompt[0])
            before = kv.num_free_blocks
            if not kv.allocate(rid, len(tokens[rid])):
                assert kv.num_free_blocks == before  # failure changes nothing
                tokens[rid].pop()
            else:
                kv.cache_computed_blocks(rid, tokens[rid], len(tokens[rid]) - 1)
        elif op == "free" and rid in tokens:
            kv.free(rid)
            del tokens[rid]
        kv.check_invariants()
        for r, toks in tokens.items():
            assert len(kv.block_ids(r)) >= kv.blocks_needed(len(toks))
            assert NULL_BLOCK not in kv.block_ids(r)
    for rid in list(tokens):
        kv.free(rid)
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks - 1


def test_prefix_blocks_are_shared_and_ref_counted():
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(10))  # two full blocks + 2 tokens
    assert kv.allocate("a", len(prompt))
    kv.cache_computed_blocks("a", prompt, len(prompt))
    cached, num_cached = kv.find_cached_prefix(prompt)
    assert num_cached == 8 and cached == kv.block_ids("a")[:2]
    assert kv.allocate("b", len(prompt), cached)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.blocks[cached[0]].ref_count == 2
    kv.free("a")
    assert kv.blocks[cached[0]].ref_count == 1
    kv.free("b")
    kv.check_invariants()
    # Freed but still cached: a third request gets the same blocks back.
    cached_again, _ = kv.find_cached_prefix(prompt)
    assert cached_again == cached


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(8))
    kv.allocate("a", 8)
    kv.cache_computed_blocks("a", prompt, 8)
    _, num_cached = kv.find_cached_prefix(prompt)
    assert num_cached == 4


def test_evicted_block_loses_its_hash():
    kv = KVCacheManager(3, BLOCK)  # two usable blocks
    kv.allocate("a", 8)
    kv.cache_computed_blocks("a", list(range(8)), 8)
    kv.free("a")
    assert kv.allocate("b", 8)  # takes both blocks, evicting a's prefix
    assert kv.find_cached_prefix(list(range(9)))[1] == 0
    kv.check_invariants()
