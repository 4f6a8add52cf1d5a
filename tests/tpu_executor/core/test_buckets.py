"""The bucket plan from the config alone: buckets per dimension, picking, and the graph list
(its length against the compilations counted at warm-up is checked in engine/test_engine.py)."""
import dataclasses

import pytest

from tpu_executor.core.buckets import (
    BucketPlan,
    DecodeCall,
    DecodeGraph,
    DraftGraph,
    HistoryGraph,
    MixedCall,
    PrefillCall,
    PrefillGraph,
    SamplerGraph,
    graph_label,
    pick_bucket,
)
from tpu_executor.core.config import (
    CacheConfig,
    CompileConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def config(tmp_path, max_model_len=320, chunked=True, budget=2048, device="xla", speculative=None,
           **compile_options):
    return EngineConfig(model=ModelConfig(model=str(tmp_path)), cache=CacheConfig(block_size=16),
                        scheduler=SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=budget,
                                                  enable_chunked_prefill=chunked),
                        compile=CompileConfig(**compile_options), device=DeviceConfig(device),
                        max_model_len=max_model_len, speculative=speculative)


def test_eager_devices_run_each_call_at_its_own_size(tmp_path):
    """The native path compiles nothing, so neither a pack nor a decode batch is padded."""
    plan = BucketPlan.from_config(config(tmp_path, device="cpu", prefill_buckets=(64, 128)))
    assert plan.prefill_graph(65, 80) == PrefillGraph(65, 80)
    assert plan.decode_graph(3, 5) == DecodeGraph(3, 5)
    compiled = BucketPlan.from_config(config(tmp_path, prefill_buckets=(64, 128)))
    assert compiled.prefill_graph(65, 80) == PrefillGraph(128, 256)
    assert compiled.decode_graph(3, 5) == DecodeGraph(8, 20)
    ranks = dataclasses.replace(config(tmp_path, device="cpu", prefill_buckets=(64, 128)),
                                parallel=ParallelConfig(tensor_parallel_size=2))
    assert BucketPlan.from_config(ranks).prefill_graph(65, 80) == PrefillGraph(128, 256)


def test_eager_devices_run_the_last_pack_and_the_decodes_in_one_call(tmp_path):
    from tpu_executor.core.step import DecodeWork, PrefillWork, SchedulerOutput

    prefills = tuple(PrefillWork(f"p{i}", (1,) * 60, 0, (1,) * 4, None) for i in range(3))
    decodes = tuple(DecodeWork(f"d{i}", 5, 20 + i * 16, (2,) * 4, None) for i in range(3))
    step = SchedulerOutput(prefills=prefills, decodes=decodes)
    options = dict(device="cpu", prefill_buckets=(64, 128), max_prefill_seqs=2)
    calls = BucketPlan.from_config(config(tmp_path, **options)).model_calls(step)
    assert [type(call) for call in calls] == [PrefillCall, MixedCall]
    mixed = calls[1]
    assert len(mixed.prefill.pack) == 1 and mixed.prefill.graph == PrefillGraph(60, 64)
    assert mixed.decode.work == decodes and mixed.decode.graph == DecodeGraph(3, 4)
    # Without decodes, and on a compiled device, the calls stay apart.
    calls = BucketPlan.from_config(config(tmp_path, **options)).model_calls(SchedulerOutput(prefills=prefills))
    assert [type(call) for call in calls] == [PrefillCall, PrefillCall]
    calls = BucketPlan.from_config(config(tmp_path, **dict(options, device="xla"))).model_calls(step)
    assert [type(call) for call in calls] == [PrefillCall, PrefillCall, DecodeCall]


@pytest.mark.parametrize("chunked", [True, False])
def test_buckets_are_cut_at_the_limits(tmp_path, chunked):
    plan = BucketPlan.from_config(config(tmp_path, chunked=chunked, prefill_buckets=(64, 128),
                                         decode_buckets=(4, 8, 32, 64), decode_context_buckets=(128, 512),
                                         max_prefill_seqs=4))
    # whole prompts: max_model_len joins (a full prompt must fit); chunks: none above 128
    assert plan.prefill_token_buckets == ((64, 128) if chunked else (64, 128, 320))
    assert plan.context_token_buckets == (128, 320)
    assert plan.decode_row_buckets == (4, 8, 24)          # cut at max_num_seqs
    assert plan.decode_context_block_buckets == (8, 20)   # 128 and 320 tokens, in 16-token blocks
    assert plan.sampler_row_buckets == (4, 8, 24)         # decode rows plus the prefill pack size
    assert plan.logprob_widths == (0, 20)


def test_prefill_buckets_above_the_context_are_kept_for_packing(tmp_path):
    plan = BucketPlan.from_config(config(tmp_path, max_model_len=256, prefill_buckets=(128, 512, 1024)))
    assert plan.prefill_token_buckets == (128, 512, 1024)


def test_chunked_prefill_buckets_stop_at_the_token_budget(tmp_path):
    plan = BucketPlan.from_config(config(tmp_path, max_model_len=8192, budget=100, prefill_buckets=(64, 128, 512),
                                         decode_context_buckets=(512, 2048)))
    assert plan.prefill_token_buckets == (64, 112)  # the budget, rounded up to whole blocks
    assert plan.context_token_buckets == (512, 2048, 8192)
    assert plan.max_prefill_keys == 8192


def test_context_widths_grow_4x_up_to_the_model_length(tmp_path):
    plan = BucketPlan.from_config(config(tmp_path, max_model_len=32768, budget=512, decode_context_buckets=(512,)))
    assert plan.context_token_buckets == (512, 2048, 8192, 32768)
    assert plan.decode_context_block_buckets == (32, 128, 512, 2048)


def test_picking_a_bucket(tmp_path):
    plan = BucketPlan.from_config(config(tmp_path, chunked=False, prefill_buckets=(64, 128), decode_buckets=(4, 8),
                                         decode_context_buckets=(128,)))
    # short forms: the tokens plus a page per packed prompt (8 x 16 keys)
    assert plan.prefill_graph(65, 80) == PrefillGraph(128, 256)
    assert plan.prefill_graph(20, 191) == PrefillGraph(64, 192)
    assert plan.prefill_graph(64, 192) == PrefillGraph(64, 192)    # no padding query: no padding key
    assert plan.prefill_graph(20, 192) == PrefillGraph(64, 320)    # no room left for the padding key
    # 128 has no long forms (only buckets 4x apart from the top do): the short form that holds the keys
    assert plan.long_form_buckets() == (64, 320)
    assert plan.prefill_graph(100, 300) == PrefillGraph(320, 448)
    assert plan.decode_graph(5, 9) == DecodeGraph(8, 20)
    assert plan.sampler_graph(8, wants_logprobs=True, all_greedy=False) == SamplerGraph(8, 20, False)
    assert plan.sampler_graph(8, wants_logprobs=False, all_greedy=True) == SamplerGraph(8, 0, True)
    with pytest.raises(ValueError, match="exceeds the largest bucket 320"):
        plan.prefill_graph(321, 321)
    assert pick_bucket((2, 8), 2) == 2


def test_graph_list_covers_every_combination_once(tmp_path):
    plan = BucketPlan.from_config(config(tmp_path, prefill_buckets=(32, 128), decode_buckets=(2, 8),
                                         decode_context_buckets=(128,), max_prefill_seqs=8, max_logprobs=5))
    graphs = plan.graphs()
    assert len(graphs) == len(set(graphs))
    # each token bucket in the short form (its tokens plus 8 pages of 16) and with every wider context width
    assert [g for g in graphs if isinstance(g, PrefillGraph)] == [
        PrefillGraph(32, 160), PrefillGraph(32, 320), PrefillGraph(128, 256), PrefillGraph(128, 320)]
    # rows (2, 8, and max_num_seqs 24) x context widths (128 and max_model_len 320 tokens)
    assert len([g for g in graphs if isinstance(g, DecodeGraph)]) == 3 * 2
    # rows (2, 8, 24; the prefill pack size 8 is among them) x logprobs (0, 5) x greedy or not
    # x logits processing or not
    assert len([g for g in graphs if isinstance(g, SamplerGraph)]) == 3 * 2 * 2 * 2
    # processing state filled from histories up to max_model_len (320: narrower than the first 256 x 4)
    assert [g for g in graphs if isinstance(g, HistoryGraph)] == [HistoryGraph(256), HistoryGraph(320)]


def test_speculation_adds_a_verify_graph_per_decode_graph(tmp_path):
    """Verifies run on verify graphs: each decode graph's sequences and table width with k + 1
    query tokens a sequence, the sampler over all of them; the decode rows stay."""
    from tpu_executor.core.speculative import SpeculativeConfig

    options = dict(prefill_buckets=(32, 128), decode_buckets=(2, 8), decode_context_buckets=(128,), max_prefill_seqs=8)
    plain = BucketPlan.from_config(config(tmp_path, **options))
    speculative = BucketPlan.from_config(config(tmp_path, speculative=SpeculativeConfig(num_speculative_tokens=3),
                                                **options))
    assert plain.decode_row_buckets == speculative.decode_row_buckets == (2, 8, 24)
    added = [g for g in speculative.graphs() if g not in plain.graphs()]
    assert [g for g in added if isinstance(g, DecodeGraph)] == [DecodeGraph(r, c, 4) for r in (2, 8, 24)
                                                                for c in (8, 20)]
    # The sampler over every query row (8 rows: a bucket already).
    assert {2 * 4, 8 * 4, 24 * 4} <= set(speculative.sampler_row_buckets)
    assert {g.num_rows for g in added if isinstance(g, SamplerGraph)} == {8 * 4, 24 * 4}
    # two context widths; sampler: log-probs or not, greedy or not, processing or not
    assert len(added) == 3 * 2 + 2 * (2 * 2 * 2)
    assert graph_label(DecodeGraph(8, 20, 4)) == "verify rows=8 queries=4 blocks=20"
    assert "half of them verifying 4 tokens a row" in speculative.describe()
    native = BucketPlan.from_config(config(tmp_path, device="cpu", speculative=SpeculativeConfig(), **options))
    assert native.verify_queries == 0  # exact sizes: verifies run as one pack


def test_a_draft_model_adds_its_catch_up_and_greedy_steps_graphs(tmp_path):
    """A draft model's catch-up runs over each prefill graph's shapes (prompt chunks) and over
    decode shapes up to a row per token of every sequence's verify (short texts), its greedy
    steps over each decode graph's (its drafting rows); drafting one token, there are no
    steps to run."""
    from tpu_executor.core.speculative import SpeculativeConfig

    options = dict(prefill_buckets=(32, 128), decode_buckets=(2, 8), decode_context_buckets=(128,), max_prefill_seqs=8)
    for k in (1, 3):
        draft = SpeculativeConfig(method="draft_model", model=str(tmp_path), num_speculative_tokens=k)
        plan = BucketPlan.from_config(config(tmp_path, speculative=draft, **options))
        ngram = BucketPlan.from_config(config(tmp_path, speculative=SpeculativeConfig(num_speculative_tokens=k),
                                              **options))
        added = [g for g in plan.graphs() if g not in ngram.graphs()]
        prefill = [g for g in plan.graphs() if isinstance(g, PrefillGraph)]
        # Doubling from max_num_seqs (24) to every sequence's k + 1 rows.
        catch_up_rows = (2, 8, 24, 48, 96) if k == 3 else (2, 8, 24, 48)
        catch_up = [DecodeGraph(r, c) for r in catch_up_rows for c in (8, 20)]
        steps = [DecodeGraph(r, c) for r in (2, 8, 24) for c in (8, 20)] if k > 1 else []
        assert added == [DraftGraph(g) for g in prefill + catch_up] + [DraftGraph(g, steps=True) for g in steps]
        assert graph_label(added[0]) == f"draft catch-up {graph_label(prefill[0])}"
        assert f"drafter {len(added)} graphs" in plan.describe()


def test_verifies_run_with_the_decodes_in_a_verify_graph(tmp_path):
    from tpu_executor.core.speculative import SpeculativeConfig
    from tpu_executor.core.step import DecodeWork, PrefillWork, SchedulerOutput

    verifies = tuple(PrefillWork(f"v{i}", (1, 2, 3, 4), 46, (1,) * 4, None) for i in range(5))
    decodes = tuple(DecodeWork(f"d{i}", 5, 20, (2,) * 2, None) for i in range(2))
    plan = BucketPlan.from_config(config(tmp_path, speculative=SpeculativeConfig(num_speculative_tokens=3),
                                         decode_buckets=(2, 8)))
    calls = plan.model_calls(SchedulerOutput(decodes=decodes, verifies=verifies))
    # One call: 2 decodes and 5 verifies are 7 sequences of 4 queries, in the 8-row bucket.
    assert [type(call) for call in calls] == [DecodeCall]
    assert calls[0].work == decodes and calls[0].verifies == verifies
    # Positions 46-49: the last (49) reads 4 pages (position 48 starts the fourth).
    assert calls[0].needed_blocks == (2, 2) + (4,) * 5
    assert calls[0].graph == DecodeGraph(8, plan.decode_graph(7, 4).context_blocks, 4)
    assert calls[0].graph.num_tokens == 32
    verify_only = plan.model_calls(SchedulerOutput(verifies=verifies))
    assert [(call.work, call.verifies) for call in verify_only] == [((), verifies)]
    assert plan.model_calls(SchedulerOutput(decodes=decodes))[0].graph.queries == 1
    # At exact sizes one call takes every verify and the decodes (it reads the weights once).
    plan = BucketPlan.from_config(config(tmp_path, device="cpu", speculative=SpeculativeConfig(),
                                         prefill_buckets=(64, 128)))
    calls = plan.model_calls(SchedulerOutput(decodes=decodes, verifies=verifies))
    assert [type(call) for call in calls] == [MixedCall]
    assert calls[0].prefill.pack == verifies and calls[0].decode.work == decodes


def test_prefills_pack_longest_first_into_the_first_pack_with_room():
    from tpu_executor.core.buckets import pack_prefills
    from tpu_executor.core.step import PrefillWork

    lengths = [300, 200, 212, 100, 40]
    work = [PrefillWork(f"r{i}", (1,) * n, 0, (), None) for i, n in enumerate(lengths)]
    packs = pack_prefills(work, max_tokens=512, max_keys=512 + 8 * 16, max_seqs=8, block_size=16)
    # In arrival order the packs would be [300, 200], [212, 100, 40]: 500 and 352 tokens.
    assert [[len(w.token_ids) for w in pack] for pack in packs] == [[300, 212], [200, 100, 40]]
    assert sorted(w.request_id for pack in packs for w in pack) == [w.request_id for w in work]
    # Each limit still holds: at most 2 sequences, and keys counted in whole pages.
    packs = pack_prefills(work, max_tokens=512, max_keys=512 + 8 * 16, max_seqs=2, block_size=16)
    assert all(len(pack) <= 2 for pack in packs) and len(packs) == 3
    packs = pack_prefills(work, max_tokens=512, max_keys=320, max_seqs=8, block_size=16)
    assert all(sum(-(-len(w.token_ids) // 16) * 16 for w in pack) <= 320 for pack in packs)
