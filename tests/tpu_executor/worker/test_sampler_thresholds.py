"""The sampler's sort-free top-k / top-p / min-p against the sort form it replaces.

The reference below is the sampler's former filter: the whole vocabulary sorted descending
(stable, so tied tokens keep the lowest ids first), top-k by rank, top-p by a cumulative sum,
min-p against the first sorted probability. The sampler finds the same thresholds by searches
over the unsorted vocabulary; these tests hold the kept sets and the seeded draws equal on
tie-heavy random rows.
"""
import pytest
import torch

from tpu_executor.worker.sampler import _filtered_logits, _filtered_logits_by_sort, _order_keys, gumbel_noise, sample

NEG_INF = float("-inf")


def sorted_reference(logits, temperature, top_k, top_p, min_p):
    """The sort form: (filtered logits, their token ids, mass before each token), sorted."""
    vocab_size = logits.shape[-1]
    safe_temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    sorted_logits, sorted_ids = torch.sort(logits / safe_temp[:, None], dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size))
    keep = ranks < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, NEG_INF), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    keep = keep & (before < top_p[:, None])
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    return sorted_logits.masked_fill(~keep, NEG_INF), sorted_ids, before


def in_id_order(values, sorted_ids):
    return torch.empty_like(values).scatter_(1, sorted_ids, values)


def reference_draws(logits, temperature, top_k, top_p, min_p, seeds, steps):
    """The sort form's tokens: Gumbel-max over the sorted filtered logits, mapped back to ids."""
    filtered, sorted_ids, _ = sorted_reference(logits, temperature, top_k, top_p, min_p)
    noise = gumbel_noise(seeds, steps, logits.shape[-1]).gather(1, sorted_ids)
    sampled = sorted_ids.gather(1, torch.argmax(filtered + noise, dim=-1, keepdim=True)).squeeze(1)
    return torch.where(temperature > 0, sampled, torch.argmax(logits, dim=-1))


def tie_heavy_rows(batch, vocab_size, seed):
    """Logits on a coarse grid (many exact ties), a tenth at -inf, and mixed sampling settings:
    top_k off / 1 / beyond the vocabulary / random, top_p 1 / small / random, min_p, temperatures."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(batch, vocab_size, generator=g) * 8) / 4
    logits[torch.rand(batch, vocab_size, generator=g) < 0.1] = NEG_INF
    logits[:, 0] = logits[:, 0].clamp(min=-1.0)  # every row keeps a finite logit
    pick = torch.randint(0, 4, (batch,), generator=g)
    top_k = torch.randint(2, vocab_size, (batch,), generator=g)
    top_k = torch.where(pick == 0, 0, torch.where(pick == 1, 1, torch.where(pick == 2, vocab_size + 7, top_k)))
    pick = torch.randint(0, 3, (batch,), generator=g)
    top_p = torch.rand(batch, generator=g).clamp(min=1e-3)
    top_p = torch.where(pick == 0, 1.0, torch.where(pick == 1, top_p * 0.05, top_p))
    min_p = torch.where(torch.rand(batch, generator=g) < 0.5, 0.0, torch.rand(batch, generator=g) * 0.3)
    temperature = torch.rand(batch, generator=g) * 2 + 0.05
    temperature[torch.rand(batch, generator=g) < 0.15] = 0.0
    seeds = torch.randint(0, 2 ** 40, (batch,), generator=g)
    steps = torch.randint(0, 1000, (batch,), generator=g)
    return logits, temperature, top_k.to(torch.int64), top_p.float(), min_p.float(), seeds, steps


@pytest.mark.parametrize("vocab_size", [7, 300, 1000])
def test_kept_sets_equal_the_stable_sort_form(vocab_size):
    """Over 3,000 tie-heavy rows the same tokens stay with the same values. The one difference:
    top_p = 1 keeps every token, where the sort form's float32 cumsum reached 1.0 before the
    tail and dropped the tokens after it (their mass before is below 1 in exact arithmetic)."""
    logits, temperature, top_k, top_p, min_p, _, _ = tie_heavy_rows(3000, vocab_size, seed=vocab_size)
    got = _filtered_logits(logits, temperature, top_k, top_p, min_p)
    filtered, sorted_ids, before = sorted_reference(logits, temperature, top_k, top_p, min_p)
    expected, before = in_id_order(filtered, sorted_ids), in_id_order(before, sorted_ids)
    nucleus_on = (top_p < 1)[:, None]
    flips = (got > NEG_INF) != (expected > NEG_INF)
    # Float rounding of the mass before a token (a masked sum here, a cumsum there) could flip a
    # token whose mass before lies within a few ulps of top_p: none does on these rows.
    assert int((flips & nucleus_on).sum()) == 0
    # At top_p = 1 the sort form's flips are exactly its rounding drops.
    rounding_drops = (before >= 1.0) & ~nucleus_on & (expected == NEG_INF)
    without_nucleus = in_id_order(*sorted_reference(logits, temperature, top_k, torch.full_like(top_p, 2.0),
                                                    min_p)[:2])
    assert torch.equal(flips & ~nucleus_on, rounding_drops & (without_nucleus > NEG_INF))
    assert torch.equal(got, torch.where(nucleus_on, expected, without_nucleus))


@pytest.mark.parametrize("vocab_size", [7, 1000])
def test_the_native_paths_sort_keeps_the_searches_set(vocab_size):
    """Eager torch (the native path) sorts, compiled graphs search: the same tokens stay, with
    the same values, on every tie-heavy row (top_p = 1 included)."""
    args = tie_heavy_rows(3000, vocab_size, seed=vocab_size + 1)[:5]
    assert torch.equal(_filtered_logits_by_sort(*args), _filtered_logits(*args))


def test_seeded_draws_equal_the_sort_form():
    """Gumbel-max over the unsorted vocabulary with each token's own noise picks the same token as
    over the sorted one, row by row, for 4,000 tie-heavy rows (greedy rows included)."""
    args = tie_heavy_rows(4000, 500, seed=11)
    got = sample(*args, num_logprobs=0, all_greedy=False).token_ids
    assert torch.equal(got, reference_draws(*args))


def rows_of(logits, top_k=0, top_p=1.0, min_p=0.0):
    logits = torch.tensor(logits, dtype=torch.float32)[None, :]
    one = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
    filtered = _filtered_logits(logits, one(1.0, torch.float32), one(top_k, torch.int64),
                                one(top_p, torch.float32), one(min_p, torch.float32))
    return torch.nonzero(filtered[0] > NEG_INF).flatten().tolist()


def test_ties_at_the_boundaries_keep_the_lowest_ids():
    assert rows_of([1.0, 2.0, 2.0, 2.0, 0.0, 2.0], top_k=2) == [1, 2]
    assert rows_of([1.0, 2.0, 2.0, 2.0, 0.0, 2.0], top_k=5) == [0, 1, 2, 3, 5]
    assert rows_of([0.0, 5.0, 0.0, 0.0], top_k=2) == [0, 1]
    # Four equal tokens of 0.25: the mass before them is 0, 0.25, 0.5, 0.75.
    assert rows_of([0.0] * 4, top_p=0.5) == [0, 1]
    assert rows_of([0.0] * 4, top_p=0.6) == [0, 1, 2]
    assert rows_of([0.0] * 4, top_p=0.6, top_k=2) == [0, 1]
    assert rows_of([NEG_INF, 0.0, NEG_INF, 0.0], top_p=0.1) == [1]
    assert rows_of([-1.0, 3.0, -1.0], min_p=0.5) == [1]


def random_floats(count):
    """Floats of ``count`` random bit patterns (NaNs left out) plus zeros, infinities, the extreme
    subnormals and normals."""
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-2 ** 31, 2 ** 31, (count,), generator=g).to(torch.int32).view(torch.float32)
    extremes = [0.0, -0.0, float("inf"), NEG_INF, 1e-45, -1e-45, 2.0 ** -126, -(2.0 ** -126), 3.4028235e38]
    return torch.cat([values[~torch.isnan(values)], torch.tensor(extremes)])


def test_order_keys_are_the_bitcast_image():
    """The keys equal the float bits with the low 31 flipped for negatives (-0.0 as 0.0), for a
    million random bit patterns and the extremes."""
    values = random_floats(1_000_000)
    bits = values.view(torch.int32)
    expected = torch.where(values == 0, 0, torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits))
    assert torch.equal(_order_keys(values), expected)


@pytest.mark.slow
def test_compiled_paths_draw_the_eager_tokens_without_a_sort():
    """torch.compile(openxla) and torchax under jax.jit (XLA on the CPU) sample the eager tokens
    on tie-heavy rows, torch_xla runs no op on the CPU (a bitcast or ``frexp`` would), and the
    traced program holds no sort."""
    import jax
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as metrics
    from torchax import interop

    from tpu_executor.kernels.binding import torchax_env

    args = tie_heavy_rows(64, 1000, seed=5)
    expected = sample(*args, num_logprobs=0, all_greedy=False).token_ids
    compiled = torch.compile(lambda *a: sample(*a, num_logprobs=0, all_greedy=False).token_ids,
                             backend="openxla", fullgraph=True, dynamic=False)
    device = xm.xla_device()
    metrics.clear_counters()
    assert torch.equal(compiled(*[a.to(device) for a in args]).cpu(), expected)
    assert [name for name in metrics.counter_names() if name.startswith("aten::")] == []
    # The keys of normal floats (XLA flushes subnormals) are the eager ones, bit for bit.
    values = random_floats(100_000)
    values = values[(values.abs() >= 2.0 ** -126) | (values == 0)]
    keys = torch.compile(_order_keys, backend="openxla", fullgraph=True, dynamic=False)
    assert torch.equal(keys(values.to(device)).cpu(), _order_keys(values))

    env = torchax_env()  # usable from this thread whichever engine built torchax's environment

    def program(*arrays):
        with env:
            return interop.jax_view(sample(*interop.torch_view(arrays), num_logprobs=0, all_greedy=False).token_ids)

    def keys_program(array):
        with env:
            return interop.jax_view(_order_keys(interop.torch_view(array)))

    with jax.enable_x64(True):
        arrays = [jax.device_put(a.numpy(), jax.devices("cpu")[0]) for a in args]
        lowered = jax.jit(program).lower(*arrays)
        assert "stablehlo.sort" not in lowered.as_text()
        assert torch.equal(torch.from_numpy(jax.device_get(lowered.compile()(*arrays)).copy()), expected)
        got_keys = jax.device_get(jax.jit(keys_program)(jax.device_put(values.numpy(), jax.devices("cpu")[0])))
        assert torch.equal(torch.from_numpy(got_keys.copy()), _order_keys(values))
