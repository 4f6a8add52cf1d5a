"""Op registry: priority, per-call fallback, selection strings, and the reference ops."""
import pytest
import torch

from tpu_executor.kernels import OpRegistry, Provider
from tpu_executor.kernels.paged_attention.reference import paged_attention
from tpu_executor.kernels.prefill_attention.reference import prefill_attention


def make_registry():
    registry = OpRegistry()
    registry.register("op", Provider("reference", lambda x: "ref", priority=0, is_reference=True))
    registry.register("op", Provider("fast", lambda x: "fast", priority=10, supports_args=lambda x: x < 100))
    registry.register("op", Provider("absent", lambda x: "absent", priority=20, supported=lambda: False))
    return registry


def test_priority_then_per_call_fallback():
    registry = make_registry()
    assert registry.dispatch("op", 5) == "fast"
    assert registry.dispatch("op", 500) == "ref"


@pytest.mark.parametrize("selection, expected", [("all", "fast"), ("none", "ref"), ("all,-op", "ref"),
                                                 ("none,+op", "fast")])
def test_selection_strings(selection, expected):
    registry = make_registry()
    registry.configure(selection)
    assert registry.dispatch("op", 5) == expected


@pytest.mark.parametrize("selection", ["fast", "all,op", "all,-nope"])
def test_bad_selection_is_rejected(selection):
    with pytest.raises(ValueError):
        make_registry().configure(selection)


def test_recording_notes_each_call_and_the_providers_that_refused_it():
    registry = make_registry()
    registry.register("op", Provider("picky", lambda x: "picky", priority=15, supports_args=lambda x: x < 0,
                                     explain=lambda x: f"{x} is not negative"))
    with registry.recording() as selections:
        registry.dispatch("op", 5)
    assert [(s.provider.name, [(p.name, why) for p, why in s.refused]) for s in selections] == \
        [("fast", [("picky", "5 is not negative")])]
    registry.dispatch("op", 6)
    assert len(selections) == 1


def test_recording_while_tracing_notes_once_and_leaves_no_guard():
    """A graph traced while recording is noted at its trace, and is not traced again once
    recording stops (a guard on the recording state would recompile every warm-up graph)."""
    registry = OpRegistry()
    registry.register("op", Provider("reference", lambda x: x + 1, priority=0, is_reference=True))
    traces = []

    def backend(graph, example_inputs):
        traces.append(graph)
        return graph

    compiled = torch.compile(lambda x: registry.dispatch("op", x) * 2, backend=backend, fullgraph=True)
    with registry.recording() as selections:
        compiled(torch.ones(3))
    for _ in range(3):
        torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 4.0))
    assert len(traces) == 1
    assert [(s.op, s.shapes, s.provider.name) for s in selections] == [("op", "[3] f32", "reference")]


def test_fingerprint_changes_with_selection():
    registry = make_registry()
    before = registry.fingerprint()
    registry.configure("none")
    assert registry.fingerprint() != before


def test_source_hash_covers_the_kernel_module():
    """A provider's hash reads its kernel's file (without importing it): editing the kernel
    changes the compile-cache key."""
    plain = Provider("pallas", test_source_hash_covers_the_kernel_module, priority=1)
    with_kernel = Provider("pallas", test_source_hash_covers_the_kernel_module, priority=1,
                           sources=("tpu_executor.kernels.gmm.kernel",))
    assert plain.source_hash() != with_kernel.source_hash()
    with pytest.raises(ValueError, match="no_such_module"):
        Provider("x", plain.fn, priority=1, sources=("no_such_module",)).source_hash()


EAGER_PROVIDERS = {"gmm": "eager_grouped", "paged_attention": "eager_sdpa", "prefill_attention": "eager_segments",
                   "rms_norm": "eager_fused", "lora_matmul": "eager_grouped"}


def test_every_op_registers_pallas_first_and_the_reference_last():
    from tpu_executor.kernels import register_all

    registry = register_all(OpRegistry())
    assert registry.ops() == ["act_and_mul", "gmm", "lora_matmul", "packed_matmul", "paged_attention",
                              "prefill_attention", "rms_norm", "rotary_embedding", "w4a16_matmul", "w8a16_matmul",
                              "w8a8_matmul", "write_kv_cache"]
    # Without a Pallas kernel: the elementwise ops (XLA fuses them itself; their C kernels are
    # the CPU's) and the CPU's panel matmul (no TPU layer packs its weights so); lora_matmul
    # (two small dense matmuls: XLA's own; the C kernel on the native path).
    first = {"act_and_mul": "cpu_c", "rms_norm": "cpu_c", "rotary_embedding": "cpu_c", "write_kv_cache": "cpu_c",
             "packed_matmul": "cpu_c", "lora_matmul": "cpu_c"}
    for op in registry.ops():
        names = [p.name for p in registry.providers(op)]
        assert names[-1] == "reference", names
        assert names[0] == first.get(op, "pallas"), names
        # No TPU here: traced calls land on the reference; eager calls on the eager providers.
        eager = registry.select(op, torch.zeros(1))
        assert eager.name == EAGER_PROVIDERS.get(op, "reference"), eager.name


def test_paged_decode_equals_prefill_on_the_last_token():
    """The two references agree: decoding token t equals prefill's row t over the same pages,
    also when another sequence is packed before it."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, heads, dim, block, blocks = 2, 4, 8, 4, 10
    k_pages = torch.randn(kv_heads, blocks, block, dim, generator=gen)
    v_pages = torch.randn(kv_heads, blocks, block, dim, generator=gen)
    table = torch.tensor([3, 7, 1, 9])
    q = torch.randn(16, heads, dim, generator=gen)
    # Pack: segment 0 is 5 tokens in block 2, segment 1 is our 16 tokens.
    other = torch.arange(8, 13)
    ours = table.repeat_interleave(block) * block + torch.arange(16) % block
    slots = torch.cat([other, ours])
    positions = torch.cat([torch.arange(5), torch.arange(16)])
    segments = torch.cat([torch.zeros(5, dtype=torch.int64), torch.ones(16, dtype=torch.int64)])
    packed_q = torch.cat([torch.randn(5, heads, dim, generator=gen), q])
    for soft_cap, window in [(None, None), (5.0, 6)]:
        full = prefill_attention(packed_q, k_pages, v_pages, slots, positions, segments, positions,
                                 segments, scale=0.3, soft_cap=soft_cap, sliding_window=window)[5:]
        for t in (0, 5, 15):
            one = paged_attention(q[t:t + 1], k_pages, v_pages, torch.tensor([t + 1]), table[None],
                                  scale=0.3, soft_cap=soft_cap, sliding_window=window)
            torch.testing.assert_close(one[0], full[t])



def test_a_verifys_query_rows_equal_decodes_one_position_at_a_time():
    """Several queries per sequence (a verify of drafts): row j of a sequence with context n
    equals a decode at context n - queries + 1 + j; rows before a short context's first
    position see key 0, like a decode at context 1."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, heads, dim, block, queries = 2, 4, 8, 4, 5
    k_pages, v_pages = (torch.randn(kv_heads, 12, block, dim, generator=gen) for _ in range(2))
    tables = torch.tensor([[3, 7, 1, 9], [2, 5, 0, 0], [8, 0, 0, 0]])
    lens = torch.tensor([14, 6, 2])
    q = torch.randn(3 * queries, heads, dim, generator=gen)
    for soft_cap, window in [(None, None), (5.0, 3)]:
        kwargs = dict(scale=0.3, soft_cap=soft_cap, sliding_window=window)
        rows = paged_attention(q, k_pages, v_pages, lens, tables, **kwargs)
        for seq in range(3):
            for j in range(queries):
                length = max(int(lens[seq]) - queries + 1 + j, 1)
                one = paged_attention(q[seq * queries + j][None], k_pages, v_pages, torch.tensor([length]),
                                      tables[seq][None], **kwargs)
                torch.testing.assert_close(rows[seq * queries + j], one[0])

@pytest.mark.parametrize("op", ["gmm", "paged_attention", "prefill_attention"])
def test_fake_gives_the_reference_output_shape_and_dtype(op):
    """The fake that torch.compile traces opaque providers with matches the spec's reference."""
    import importlib

    import numpy as np

    spec = importlib.import_module(f"tpu_executor.kernels.{op}.ops").SPEC
    rng = np.random.default_rng(3)
    for _ in range(10):
        case = spec.generate(rng)
        fake, real = case.run(spec.fake), case.run(spec.reference)
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype), case.label


def test_eager_grouped_gmm_matches_the_reference():
    import numpy as np

    from tpu_executor.kernels import register_all
    from tpu_executor.kernels.gmm import ops as gmm_ops

    registry = register_all(OpRegistry())
    eager = next(p for p in registry.providers("gmm") if p.name == "eager_grouped")
    rng = np.random.default_rng(3)
    for _ in range(20):
        case = gmm_ops.SPEC.generate(rng)
        gmm_ops.SPEC.assert_close(case.run(eager.fn), case.run(gmm_ops.SPEC.reference), case.label)
