"""The cost estimates of the paged-attention, prefill-attention and grouped-matmul kernels against
a walk of their grids: each kernel runs with ``pl.pallas_call`` replaced by a recorder (its grid
spec, operands and declared estimate), and the walk applies the BlockSpecs' own index maps as
Pallas pipelining does (a block moves when its index differs from the previous grid step's),
plus each kernel's rule for the pages it DMAs itself. The estimate must equal the walk at the
convention it states, and reach the TPU program (the lowered call, and libtpu's
``cost_analysis``)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tests.pallas_kernels.kernel_cases import in_fresh_process
from tpu_executor.kernels.gmm import kernel as gmm_kernel
from tpu_executor.kernels.paged_attention import kernel as paged_kernel
from tpu_executor.kernels.prefill_attention import kernel as prefill_kernel
from tpu_executor.kernels.tpu_layout import lowering_chip


@dataclasses.dataclass
class Call:
    """One recorded ``pallas_call``: what the walk needs."""
    kernel: functools.partial
    spec: object
    out_shape: jax.ShapeDtypeStruct
    estimate: pl.CostEstimate
    args: tuple

    @property
    def scalars(self):
        return [np.asarray(a) for a in self.args[:self.spec.num_scalar_prefetch]]

    @property
    def operands(self):
        return self.args[self.spec.num_scalar_prefetch:]


def recorded_calls(fn, *args, **kwargs) -> list:
    """The pallas_calls ``fn`` makes, run eagerly (concrete scalars), each returning zeros."""
    calls = []

    def fake_pallas_call(kernel, *, grid_spec, out_shape, cost_estimate=None, **_):
        def run(*operands):
            calls.append(Call(kernel, grid_spec, out_shape, cost_estimate, operands))
            return jnp.zeros(out_shape.shape, out_shape.dtype)
        return run

    with mock.patch.object(pl, "pallas_call", fake_pallas_call), jax.disable_jit():
        fn(*args, **kwargs)
    return calls


def pipelined_bytes(call: Call) -> int:
    """The BlockSpec'd operands' and output's blocks, one each time its index changes, plus the
    scalar-prefetch operands copied into SMEM once."""
    blocked = [(s, x.dtype.itemsize) for s, x in zip(call.spec.in_specs, call.operands) if s.index_map is not None]
    blocked.append((call.spec.out_specs, call.out_shape.dtype.itemsize))
    last, moved, scalars = [None] * len(blocked), 0, call.scalars
    for step in itertools.product(*(range(d) for d in call.spec.grid)):
        for i, (spec, size) in enumerate(blocked):
            index = tuple(int(x) for x in spec.index_map(*step, *scalars))
            if index != last[i]:
                last[i] = index
                moved += size * math.prod(d or 1 for d in spec.block_shape)
    return moved + sum(a.nbytes for a in scalars)


def totals(calls, walk) -> tuple:
    """(declared, walked): (bytes, flops, transcendentals) summed over the calls."""
    declared = [sum(getattr(c.estimate, f) for c in calls) for f in ("bytes_accessed", "flops", "transcendentals")]
    walked = [sum(column) for column in zip(*(walk(c) for c in calls))]
    return tuple(declared), tuple(walked)


def paged_walk(call: Call) -> tuple:
    """The paged kernel's own DMAs: chunk ``first`` at its step, chunk c + 1 from step c < last."""
    lens, _ = call.scalars
    q4, k_pages = call.operands[0], call.operands[1]
    options = call.kernel.keywords
    _, ppc, block_size, head_dim = call.spec.scratch_shapes[0].shape
    rows, tokens = q4.shape[2], ppc * block_size
    chunk_bytes = 2 * ppc * block_size * head_dim * k_pages.dtype.itemsize
    moved, flops, exps = pipelined_bytes(call), 0, 0
    for b, _h, c in itertools.product(*(range(d) for d in call.spec.grid)):
        first, last = (int(x) for x in paged_kernel._chunk_range(
            int(lens[b]), tokens, options["sliding_window"], options["queries"]))
        active = first <= c <= last
        moved += chunk_bytes * (int(active and c == first) + int(active and c < last))
        flops += active * 4 * rows * tokens * head_dim
        exps += active * (rows * tokens * (1 + (options["soft_cap"] is not None)) + rows)
    return moved, flops, exps


def paged_args(batch, queries, heads, kv_heads, block_size, width, dtype, lengths=None, seed=0):
    """A paged call's operands: random tables of ``width`` pages, every context full unless given."""
    rng = np.random.default_rng(seed)
    pages = jnp.zeros((kv_heads, 4 * width, block_size, 128), dtype)
    tables = jnp.asarray(rng.integers(0, 4 * width, (batch, width)), jnp.int32)
    full = np.full(batch, width * block_size) if lengths is None else lengths
    return (jnp.zeros((batch * queries, heads, 128), dtype), pages, pages, jnp.asarray(full, jnp.int32), tables)


PAGED = [  # (batch, queries, heads, kv_heads, block_size, width, dtype, options)
    (64, 1, 32, 8, 16, 32, jnp.bfloat16, {}),  # Llama-3.1-8B, a 512-token decode bucket
    (4, 5, 8, 2, 16, 40, jnp.bfloat16, {"pages_per_chunk": 3, "sliding_window": 100, "soft_cap": 30.0}),
    (3, 1, 4, 4, 8, 17, jnp.float32, {"pages_per_chunk": 4, "sliding_window": 20}),
    (2, 3, 4, 2, 16, 9, jnp.float32, {"pages_per_chunk": 1, "soft_cap": 50.0}),
]


@pytest.mark.parametrize("batch, queries, heads, kv_heads, block_size, width, dtype, options", PAGED)
def test_paged_attention_declares_what_its_grid_fetches_at_full_context(
        batch, queries, heads, kv_heads, block_size, width, dtype, options):
    args = paged_args(batch, queries, heads, kv_heads, block_size, width, dtype)
    calls = recorded_calls(paged_kernel.paged_attention, *args, scale=0.1, **options)
    declared, walked = totals(calls, paged_walk)
    assert declared == walked
    if options.get("sliding_window") is None:  # every row reads its table's pages, whole chunks
        ppc = calls[0].spec.scratch_shapes[0].shape[1]
        keys = -(-width // ppc) * ppc * block_size
        assert declared[1] == 2 * 2 * batch * queries * heads * 128 * keys


def test_paged_attention_at_shorter_contexts_fetches_less_than_it_declares():
    """Without a window the full context is the bound: real, shorter lengths walk under it."""
    lengths = np.array([1, 17, 100, 250, 256, 0])
    args = paged_args(6, 1, 8, 2, 16, 16, jnp.bfloat16, lengths)
    calls = recorded_calls(paged_kernel.paged_attention, *args, scale=0.1, pages_per_chunk=2)
    declared, walked = totals(calls, paged_walk)
    assert all(w < d for w, d in zip(walked, declared)), (walked, declared)


def test_paged_attention_sub_batches_each_declare_their_own_rows(monkeypatch):
    monkeypatch.setattr(paged_kernel, "SMEM_TABLE_BUDGET_BYTES", 2 * 12 * 4)  # two table rows a call
    args = paged_args(5, 2, 8, 2, 16, 12, jnp.float32)
    calls = recorded_calls(paged_kernel.paged_attention, *args, scale=0.1, pages_per_chunk=4)
    declared, walked = totals(calls, paged_walk)
    assert len(calls) == 3 and declared == walked


def prefill_walk(call: Call) -> tuple:
    """The prefill kernel's own DMAs: key block 0 at j == 0 if needed, block j + 1 from step j."""
    needed = call.scalars[0]
    qg, k_pages = call.operands[0], call.operands[1]
    options = call.kernel.keywords
    kv_heads, q_blocks, k_blocks = call.spec.grid
    _, pages_per_block, block_size, head_dim = call.spec.scratch_shapes[0].shape
    rows, keys = qg.shape[1] * call.spec.in_specs[0].block_shape[2], pages_per_block * block_size
    block_bytes = 2 * keys * head_dim * k_pages.dtype.itemsize
    moved, flops, exps = pipelined_bytes(call), 0, 0
    for _h, i, j in itertools.product(range(kv_heads), range(q_blocks), range(k_blocks)):
        row = needed[i * k_blocks:(i + 1) * k_blocks]
        starts = int(j == 0 and row[0] == 1) + int(j + 1 < k_blocks and row[min(j + 1, k_blocks - 1)] == 1)
        moved += block_bytes * starts
        flops += (row[j] == 1) * 4 * rows * keys * head_dim
        exps += (row[j] == 1) * (rows * keys * (1 + (options["soft_cap"] is not None)) + rows)
    return moved, flops, exps


def one_prompt(num_tokens, num_keys, heads, kv_heads, block_size, dtype, seed=0):
    """One prompt whose queries are the last ``num_tokens`` of its ``num_keys`` keys, its pages
    scattered over the cache: the layout the estimate states."""
    num_pages = -(-num_keys // block_size)
    page_of = np.random.default_rng(seed).permutation(4 * num_pages)[:num_pages]
    slots = page_of[np.arange(num_keys) // block_size] * block_size + np.arange(num_keys) % block_size
    pages = jnp.zeros((kv_heads, 4 * num_pages, block_size, 128), dtype)
    ints = functools.partial(jnp.asarray, dtype=jnp.int32)
    return (jnp.zeros((num_tokens, heads, 128), dtype), pages, pages, ints(slots), ints(np.arange(num_keys)),
            ints(np.zeros(num_keys)), ints(np.arange(num_keys - num_tokens, num_keys)), ints(np.zeros(num_tokens)))


PREFILL = [  # (num_tokens, num_keys, heads, kv_heads, block_size, dtype, options)
    (128, 256, 8, 2, 16, jnp.bfloat16, {}),
    (100, 300, 4, 2, 16, jnp.bfloat16, {"block_q": 16, "block_k": 128, "sliding_window": 64}),
    (64, 64, 4, 4, 32, jnp.float32, {"block_q": 16, "block_k": 128, "soft_cap": 20.0}),
    (40, 512, 2, 1, 16, jnp.float32, {"block_q": 8, "block_k": 256}),
    (512, 512, 4, 1, 16, jnp.bfloat16, {"block_q": 32, "block_k": 128}),
]


@pytest.mark.parametrize("num_tokens, num_keys, heads, kv_heads, block_size, dtype, options", PREFILL)
def test_prefill_attention_declares_the_tiles_its_grid_visits(num_tokens, num_keys, heads, kv_heads, block_size,
                                                              dtype, options):
    args = one_prompt(num_tokens, num_keys, heads, kv_heads, block_size, dtype)
    calls = recorded_calls(prefill_kernel.prefill_attention, *args, scale=0.1, **options)
    declared, walked = totals(calls, prefill_walk)
    assert len(calls) == 1 and declared == walked
    needed = calls[0].scalars[0]
    if num_tokens == num_keys and calls[0].spec.grid[2] > 1:  # causal: key blocks past the diagonal skipped
        assert 0 < needed.sum() < needed.size


def gmm_walk(call: Call) -> tuple:
    """Every grid step's blocks through the index maps; a visit of a non-empty group multiplies
    its tile (both halves of k for INT4)."""
    offsets, visit_groups, _ = call.scalars
    tm, tk = call.spec.in_specs[0].block_shape
    tn = call.spec.out_specs.block_shape[1]
    halves = 2 if call.kernel.keywords["form"].startswith("int4") else 1
    flops = sum(2 * tm * tk * tn * halves for _n, v, _k in itertools.product(*(range(d) for d in call.spec.grid))
                if offsets[visit_groups[v] + 1] > offsets[visit_groups[v]])
    return pipelined_bytes(call), flops, 0


def expert_weights(form, groups, k, n, transpose_rhs=False):
    """(rhs, side tensors) for ``form``: plain bf16, INT8 per channel, INT4 groups of 128 + zeros."""
    if form == "plain":
        return jnp.zeros((groups, n, k) if transpose_rhs else (groups, k, n), jnp.bfloat16), ()
    if form == "int8":
        return jnp.zeros((groups, k, n), jnp.int8), (jnp.zeros((groups, n), jnp.float32),)
    side = jnp.zeros((groups, k // 128, n), jnp.float32)
    return jnp.zeros((groups, k // 2, n), jnp.int8), (side, side)


GMM = [  # (group sizes, k, n, form, tiling, transpose_rhs): every group holds rows
    ([50, 70, 60, 76], 256, 512, "plain", None, False),  # one tile of each dimension
    ([30, 41, 57, 22, 50], 384, 256, "plain", (64, 128, 128), True),  # rows padded, transposed
    ([20, 40, 28, 40], 256, 512, "int8", (32, 128, 256), False),
    ([25, 40, 31], 512, 256, "int4", (32, 128, 128), False),  # INT4, two k-tiles a half
    ([3] * 32, 512, 256, "int4", (32, 256, 128), False),  # INT4, one k-tile: experts fetched per run
    ([1, 2, 3, 4, 5, 6, 7, 4], 256, 256, "int8", (32, 256, 128), False),  # one row tile, one k-tile
]


@pytest.mark.parametrize("sizes, k, n, form, tiling, transpose_rhs", GMM)
def test_gmm_declares_what_its_grid_fetches_when_every_expert_has_rows(sizes, k, n, form, tiling, transpose_rhs):
    rhs, side = expert_weights(form, len(sizes), k, n, transpose_rhs)
    lhs = jnp.zeros((sum(sizes), k), jnp.bfloat16)
    calls = recorded_calls(gmm_kernel.gmm, lhs, rhs, jnp.asarray(sizes, jnp.int32), *side,
                           transpose_rhs=transpose_rhs, tiling=tiling)
    declared, walked = totals(calls, gmm_walk)
    assert declared[0] == walked[0] and declared[2] == walked[2] == 0
    # Flops count every visit multiplying: equal when every visit has rows, else a bound.
    visits_with_rows = (np.asarray(calls[0].scalars[1]) < len(sizes)).sum()
    assert (declared[1] == walked[1]) == (visits_with_rows == calls[0].spec.grid[1]) and walked[1] <= declared[1]


def test_gmm_with_empty_experts_fetches_less_than_it_declares():
    rhs, side = expert_weights("int8", 6, 256, 256)
    calls = recorded_calls(gmm_kernel.gmm, jnp.zeros((96, 256), jnp.bfloat16), rhs,
                           jnp.asarray([40, 0, 0, 56, 0, 0], jnp.int32), *side, tiling=(32, 256, 128))
    declared, walked = totals(calls, gmm_walk)
    assert walked[0] < declared[0] and walked[1] < declared[1]


_GAP = r"(?:\\22|\\0A|\W)+"  # the backend config is JSON in a string: quotes print as \22, newlines as \0A
# jaxlib 0.10 writes remote_bytes_transferred (0 for a kernel without remote DMAs) between them.
ESTIMATE = re.compile(_GAP.join(("cost_estimate", "bytes_accessed", r"(\d+)", "flops", r"(\d+)",
                                 r"(?:remote_bytes_transferred" + _GAP + "0)?", "transcendentals", r"(\d+)")))


def lowered_estimates(fn, *args, **kwargs) -> list:
    """The cost estimates in the program ``fn`` lowers to for a TPU (no TPU needed)."""
    with lowering_chip("TPU v6 lite"):
        text = jax.jit(functools.partial(fn, **kwargs)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    return [tuple(int(x) for x in found) for found in ESTIMATE.findall(text)]


def lowered_calls(name: str):
    """(kernel, args, kwargs) of one small call of each kernel."""
    if name == "paged_attention":
        return paged_kernel.paged_attention, paged_args(8, 1, 8, 2, 16, 32, jnp.bfloat16), {"scale": 0.1}
    if name == "prefill_attention":
        return prefill_kernel.prefill_attention, one_prompt(128, 256, 8, 2, 16, jnp.bfloat16), {"scale": 0.1}
    rhs, side = expert_weights("int8", 4, 256, 512)
    return gmm_kernel.gmm, (jnp.zeros((128, 256), jnp.bfloat16), rhs, jnp.asarray([32] * 4, jnp.int32), *side), {}


@pytest.mark.parametrize("name", ["paged_attention", "prefill_attention", "gmm"])
def test_the_estimate_reaches_the_tpu_custom_call(name):
    fn, args, kwargs = lowered_calls(name)
    declared = [(c.estimate.bytes_accessed, c.estimate.flops, c.estimate.transcendentals)
                for c in recorded_calls(fn, *args, **kwargs)]
    assert lowered_estimates(fn, *args, **kwargs) == declared and declared[0][0] > 0


def compiled_bytes_with_and_without_the_estimate() -> dict:
    """libtpu's ``bytes accessed`` for a Llama-3.1-8B decode's paged attention (64 rows, 32/8
    heads, a 512-token bucket of 16-token pages) compiled for v6e-1, with the kernel's estimate
    and with a zero one."""
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.worker.jax.target import target_devices

    mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse("v6e-1"))), ("tp",))
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)
            for a in paged_args(64, 1, 32, 8, 16, 32, jnp.bfloat16)]
    fn = functools.partial(paged_kernel.paged_attention, scale=128 ** -0.5)
    declared = recorded_calls(fn, *paged_args(64, 1, 32, 8, 16, 32, jnp.bfloat16))[0].estimate.bytes_accessed
    with jax.set_mesh(mesh):  # Pallas lowers for the mesh's chip
        found = {"declared": declared, "with": jax.jit(fn).lower(*args).compile().cost_analysis()["bytes accessed"]}
        jax.clear_caches()  # the kernel's jitted trace holds the estimate it was traced with
        zero = pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=0)
        with mock.patch.object(paged_kernel, "cost_estimate", lambda *a, **k: zero):
            found["without"] = jax.jit(fn).lower(*args).compile().cost_analysis()["bytes accessed"]
    return found


@pytest.mark.slow  # libtpu's compiler, in a fresh interpreter
def test_libtpu_counts_the_paged_kernel_by_its_estimate():
    found = in_fresh_process(compiled_bytes_with_and_without_the_estimate)
    assert found["with"] - found["without"] == found["declared"] > 128 * 2 ** 20, found
