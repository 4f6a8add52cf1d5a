"""Bucket schemes: the dynamic programme is exact (brute force agrees), recipes keep their rules."""
import itertools
import random

import numpy as np
import pytest

from tpu_executor.tuning.schemes import (
    Dimension,
    gap_buckets,
    optimal_buckets,
    percent_buckets,
    pow2_buckets,
    split_budget,
)


def brute_force(dim: Dimension, k: int) -> float:
    """The least padded work over every set of at most k multiples holding the top."""
    candidates = [m for m in range(dim.multiple, dim.top, dim.multiple)]
    best = float("inf")
    for size in range(0, k):
        for chosen in itertools.combinations(candidates, size):
            best = min(best, dim.padded_work(sorted(chosen) + [dim.top]))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_optimal_buckets_match_brute_force(seed):
    rng = random.Random(seed)
    multiple = rng.choice([1, 8, 16])
    top = multiple * rng.randint(4, 10)
    sizes = np.array([rng.randint(1, top) for _ in range(rng.randint(1, 25))])
    weights = np.array([rng.randint(1, 5) for _ in sizes], dtype=float)
    dim = Dimension("d", sizes, weights, multiple, top)
    results = optimal_buckets(dim, 4)
    for k, (cost, buckets) in enumerate(results, 1):
        assert buckets[-1] == top and len(buckets) == k
        assert all(b % multiple == 0 or b == top for b in buckets)
        assert cost == pytest.approx(dim.padded_work(buckets))
        assert cost == pytest.approx(brute_force(dim, k))


def test_recipes_follow_their_rules():
    assert pow2_buckets(16, 2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert pow2_buckets(8, 20) == (8, 16, 20)
    assert gap_buckets(16, 2048, 4) == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)
    pct = percent_buckets(16, 2048, 25)
    assert pct[-1] == 2048 and all(b % 16 == 0 for b in pct)
    assert all(hi <= max(lo + 16, -(-int(lo * 1.25) // 16) * 16) for lo, hi in zip(pct, pct[1:-1]))


def test_split_budget_respects_the_graph_budget_and_beats_any_single_dimension_choice():
    rng = np.random.default_rng(0)
    dims = {"prefill": Dimension("prefill", rng.integers(1, 512, 300), np.ones(300), 16, 512),
            "rows": Dimension("rows", rng.integers(1, 33, 200), np.ones(200), 8, 32),
            "context": Dimension("context", rng.integers(1, 1024, 200), np.ones(200) * 3, 16, 1024)}
    for budget in (3, 8, 16, 24):
        plan = split_budget(dims, budget)
        assert plan.model_graphs <= budget
        assert plan.prefill[-1] == 512 and plan.rows[-1] == 32 and plan.context[-1] == 1024
    wastes = [max(split_budget(dims, b).wastes(dims).values()) for b in (4, 8, 16, 24)]
    assert wastes == sorted(wastes, reverse=True) and wastes[-1] < wastes[0]
    with pytest.raises(ValueError, match="max_graphs 1"):
        split_budget(dims, 1)
