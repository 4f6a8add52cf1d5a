"""The native path's C kernels (``cpu_c``) against THE references: attention for decode and for
packed prefill, and the gated MLP's activation."""

import numpy as np
import pytest
import torch

from tests.pallas_kernels.kernel_cases import case_kinds, engine_like_decode_batch, generated_cases
from tpu_executor.core.step import PrefillWork, SamplingMeta
from tpu_executor.kernels import OpRegistry, register_all
from tpu_executor.kernels.act_and_mul import cpu_native as act_native
from tpu_executor.kernels.act_and_mul.ops import SPEC as ACT_SPEC
from tpu_executor.kernels.paged_attention import cpu_native
from tpu_executor.kernels.paged_attention.ops import SPEC
from tpu_executor.kernels.prefill_attention import cpu_native as prefill_native
from tpu_executor.kernels.prefill_attention.ops import SPEC as PREFILL_SPEC
from tpu_executor.worker.inputs import prefill_inputs

pytestmark = pytest.mark.skipif(not cpu_native.supported(), reason="no C compiler to build the kernel")


def test_matches_the_reference_on_the_generated_fp32_cases():
    cases = [c for c in generated_cases(SPEC, seed=11) if c.args[0].dtype == torch.float32]
    for case in cases:
        assert cpu_native.supports_args(*case.args, **case.kwargs), case.label
        SPEC.assert_close(case.run(cpu_native.paged_attention), case.run(SPEC.reference), case.label)
    assert len(case_kinds(cases)) == 4  # soft-cap x window, all fp32


@pytest.mark.parametrize("window", [None, 40])
def test_a_decode_batch_of_smollm2_heads_matches_the_reference(window):
    """32 rows of 1-320 tokens, 9 heads over 3 KV heads of 64 (SmolLM2), on torch's threads."""
    args = engine_like_decode_batch(kv_heads=3, heads=9, width=22)
    kwargs = dict(scale=0.125, sliding_window=window)
    SPEC.assert_close(cpu_native.paged_attention(*args, **kwargs), SPEC.reference(*args, **kwargs), "32 rows")


def test_queries_inside_a_wider_qkv_row_are_read_in_place():
    """q as the model passes it: its heads a view of each token's q, k and v heads."""
    k_pages, v_pages, lens, tables = engine_like_decode_batch(kv_heads=3, heads=9, width=22)[1:]
    qkv = torch.randn(32, 9 + 2 * 3, 64, generator=torch.Generator().manual_seed(7))
    q = qkv[:, :9]
    kwargs = dict(scale=0.125)
    SPEC.assert_close(cpu_native.paged_attention(q, k_pages, v_pages, lens, tables, **kwargs),
                      SPEC.reference(q.contiguous(), k_pages, v_pages, lens, tables, **kwargs), "a view")


def test_a_table_that_does_not_cover_the_context_raises_before_reading():
    pages = [torch.zeros(1, 4, 8, 16) for _ in range(2)]
    q = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="row 1's context of 17 tokens"):
        cpu_native.paged_attention(q, *pages, torch.tensor([3, 17]), torch.tensor([[0, 1], [2, 3]]), scale=1.0)
    with pytest.raises(ValueError, match="row 0's context"):
        cpu_native.paged_attention(q, *pages, torch.tensor([9, 1]), torch.tensor([[0, 4], [2, 3]]), scale=1.0)


def test_serves_fp32_cpu_calls_only():
    registry = register_all(OpRegistry())
    q, pages = torch.zeros(2, 4, 16), torch.zeros(2, 3, 8, 16)
    args = (q, pages, pages, torch.tensor([1, 2]), torch.zeros(2, 1, dtype=torch.long))
    assert registry.select("paged_attention", *args, scale=1.0).name == "cpu_c"
    bf16 = (q.bfloat16(), pages.bfloat16(), pages.bfloat16(), *args[3:])
    assert registry.select("paged_attention", *bf16, scale=1.0).name == "eager_sdpa"


def test_prefill_matches_the_reference_on_the_generated_fp32_cases():
    """Packed prompts laid out as the runner lays them (prefix-cached pages, bucket padding,
    a long chunked context): every one rebuilds its block tables and runs in C."""
    rng = np.random.default_rng(5)
    cases = [PREFILL_SPEC.generate(rng, long_context=i % 4 == 0) for i in range(48)]
    cases = [c for c in cases if c.args[0].dtype == torch.float32]
    for case in cases:
        assert prefill_native.supports_args(*case.args, **case.kwargs), case.label
        assert prefill_native.prompt_tables(*case.args[3:6], case.args[1].shape[2]) is not None, case.label
        PREFILL_SPEC.assert_close(case.run(prefill_native.prefill_attention), case.run(PREFILL_SPEC.reference),
                                  case.label)
    assert len(case_kinds(cases)) == 4
    assert any(bool((c.args[7] < 0).any()) for c in cases)  # padding queries among them


def runner_pack(block_size=16):
    """prefill_inputs of three prompts (one after 32 prefix-cached tokens), padded to 96 tokens."""
    rng = np.random.default_rng(2)
    pages = rng.permutation(40).tolist()
    greedy = SamplingMeta.greedy()
    work = [PrefillWork("a", tuple(range(30)), 0, tuple(pages[0:2]), greedy),
            PrefillWork("b", tuple(range(20)), 32, tuple(pages[2:6]), greedy),
            PrefillWork("c", tuple(range(41)), 0, tuple(pages[6:9]), greedy)]
    t = prefill_inputs(work, num_tokens=96, num_keys=176, max_seqs=4, block_size=block_size)
    return t["positions"], t["context_slots"], t["key_positions"], t["key_segments"], t["query_segments"]


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_of_the_model_runners_packing_matches_the_reference(window):
    positions, slots, key_positions, key_segments, query_segments = runner_pack()
    gen = torch.Generator().manual_seed(1)
    k_pages, v_pages = (torch.randn(2, 40, 16, 64, generator=gen) for _ in range(2))
    q = torch.randn(positions.shape[0], 6, 64, generator=gen)
    args = (q, k_pages, v_pages, slots, key_positions, key_segments, positions, query_segments)
    kwargs = dict(scale=0.125, sliding_window=window)
    assert prefill_native.prompt_tables(slots, key_positions, key_segments, 16) is not None
    PREFILL_SPEC.assert_close(prefill_native.prefill_attention(*args, **kwargs),
                              PREFILL_SPEC.reference(*args, **kwargs), "runner pack")
    registry = register_all(OpRegistry())
    # Without AVX-512 the C form loses to torch's matmuls at prefill and stands aside.
    expected = "cpu_c" if cpu_native.wide_vectors() else "eager_segments"
    assert registry.select("prefill_attention", *args, **kwargs).name == expected


def test_prefill_layouts_it_cannot_rebuild_fall_back_and_still_match():
    """Keys out of position order, and a query past its prompt's keys: torch's path serves them."""
    positions, slots, key_positions, key_segments, query_segments = runner_pack()
    gen = torch.Generator().manual_seed(4)
    k_pages, v_pages = (torch.randn(1, 40, 16, 32, generator=gen) for _ in range(2))
    q = torch.randn(positions.shape[0], 2, 32, generator=gen)
    swapped = torch.arange(slots.shape[0])
    swapped[[3, 4]] = swapped[[4, 3]]
    beyond = positions.clone()
    beyond[0] = 29 + 5  # prompt "a" has 30 keys
    for layout in ((slots[swapped], key_positions[swapped], key_segments, positions),
                   (slots, key_positions, key_segments, beyond)):
        args = (q, k_pages, v_pages, *layout, query_segments)
        PREFILL_SPEC.assert_close(prefill_native.prefill_attention(*args, scale=0.2),
                                  PREFILL_SPEC.reference(*args, scale=0.2), "fallback")
    assert prefill_native.prompt_tables(slots[swapped], key_positions[swapped], key_segments, 16) is None


def test_a_plan_is_reused_only_for_the_same_unmodified_layout_tensors():
    positions, slots, key_positions, key_segments, query_segments = runner_pack()
    layout = (slots, key_positions, key_segments, positions, query_segments)
    plans = prefill_native.LastPlan()
    first = plans.get(layout, 16)
    assert plans.get(layout, 16) is first  # the next layer of the step
    assert plans.get(tuple(t.clone() for t in layout), 16) is not first  # the next step's tensors
    again = plans.get(layout, 16)
    positions[0] += 1  # a buffer refilled in place
    replanned = plans.get(layout, 16)
    assert replanned is not again and int(replanned[2][0]) == int(again[2][0]) + 1


def test_act_and_mul_matches_the_reference_on_the_generated_fp32_cases():
    cases = [c for c in generated_cases(ACT_SPEC, seed=3, count=120) if c.args[0].dtype == torch.float32]
    served = [c for c in cases if act_native.supports_args(*c.args, **c.kwargs)]
    for case in served:
        ACT_SPEC.assert_close(case.run(act_native.act_and_mul), case.run(ACT_SPEC.reference), case.label)
    assert {c.kwargs["activation"] for c in served} == {"silu", "gelu_pytorch_tanh"}
    assert {c.args[0].shape[-1] // 2 % 16 != 0 for c in served} == {True, False}  # with and without a tail


def test_act_and_mul_serves_fp32_cpu_silu_and_gelu_tanh_only():
    registry = register_all(OpRegistry())
    x = torch.randn(5, 64)
    assert registry.select("act_and_mul", x, activation="silu").name == "cpu_c"
    assert registry.select("act_and_mul", x, activation="gelu_pytorch_tanh").name == "cpu_c"
    assert registry.select("act_and_mul", x, activation="gelu").name == "reference"  # exact GELU: erf
    assert registry.select("act_and_mul", x.bfloat16(), activation="silu").name == "reference"
