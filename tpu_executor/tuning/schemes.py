"""Bucket schemes, and the optimum for a trace under a graph budget.

A bucketed dimension is a list of observed sizes with weights: prefill calls by their packed
context tokens (weight 1 a call), decode calls by rows (weight 1) and by the context width of
their longest row (weight: the call's rows, since each row reads that width). Padding a size
``s`` to bucket ``b`` costs ``w * b`` instead of ``w * s``; a dimension's *waste* is
``1 - sum(w * s) / sum(w * b)``, the share of the padded work that padding added.

Schemes, each giving a dimension's buckets from its multiple and its top (the engine's limit,
always the last bucket):

* ``pow2``: powers of two times the multiple (today's default shape);
* ``gap:N``: doubling up to ``top / N``, then steps of ``top / N`` (vLLM's TPU padding);
* ``pct:P``: a new bucket once the next size would pad more than ``P`` percent;
* ``optimal``: the exact minimum of padded work for the trace with ``k`` buckets (dynamic
  programming over the sorted observed sizes), for every ``k``; ``split_budget`` then shares a
  graph budget between the dimensions (prefill graphs + decode rows x context graphs).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

Buckets = Tuple[int, ...]


def round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple


@dataclass(frozen=True)
class Dimension:
    """One bucketed size: observed sizes and weights, the kernels' multiple, and the top."""

    name: str
    sizes: np.ndarray
    weights: np.ndarray
    multiple: int
    top: int

    def padded_work(self, buckets: Sequence[int]) -> float:
        if not len(self.sizes):
            return 0.0
        picked = np.asarray(buckets)[np.searchsorted(buckets, self.sizes)]
        return float((picked * self.weights).sum())

    def waste(self, buckets: Sequence[int]) -> float:
        padded = self.padded_work(buckets)
        return 1.0 - float((self.sizes * self.weights).sum()) / padded if padded else 0.0


# ---- fixed recipes --------------------------------------------------------------------------
def pow2_buckets(multiple: int, top: int) -> Buckets:
    buckets, size = [], multiple
    while size < top:
        buckets.append(size)
        size *= 2
    return tuple(buckets) + (top,)


def gap_buckets(multiple: int, top: int, parts: int) -> Buckets:
    """Doubling from ``multiple`` up to the gap ``top / parts``, then steps of the gap."""
    gap = max(multiple, round_up(top // parts, multiple))
    buckets = [b for b in pow2_buckets(multiple, gap) if b < gap]
    size = gap
    while size < top:
        buckets.append(size)
        size += gap
    return tuple(buckets) + (top,)


def percent_buckets(multiple: int, top: int, percent: float) -> Buckets:
    """Each bucket at most ``1 + percent/100`` times the one below (and one multiple more)."""
    buckets, size = [], multiple
    while size < top:
        buckets.append(size)
        size = max(size + multiple, round_up(size * (1 + percent / 100.0), multiple))
    return tuple(buckets) + (top,)


# ---- the optimum ----------------------------------------------------------------------------
def optimal_buckets(dim: Dimension, max_buckets: int) -> List[Tuple[float, Buckets]]:
    """For k = 1, 2, ...: the (padded work, buckets) of the best k buckets, the top always
    last. Only observed sizes (rounded to the multiple) need be candidates: a bucket between
    two of them pads more than the lower one would."""
    candidates = np.array(sorted({round_up(s, dim.multiple) for s in dim.sizes if s <= dim.top} | {dim.top}))
    at = np.searchsorted(candidates, [round_up(s, dim.multiple) for s in dim.sizes])
    weight = np.bincount(at, weights=dim.weights, minlength=len(candidates)) if len(at) else np.zeros(len(candidates))
    below = np.concatenate([[0.0], np.cumsum(weight)])  # below[j + 1]: weight of candidates 0..j
    n = len(candidates)
    levels = min(max_buckets, n)
    cost = np.full((levels + 1, n), np.inf)
    choice = np.zeros((levels + 1, n), dtype=np.int64)
    cost[1] = below[1:] * candidates
    for k in range(2, levels + 1):
        for j in range(k - 1, n):
            prev = np.arange(k - 2, j)
            options = cost[k - 1, prev] + (below[j + 1] - below[prev + 1]) * candidates[j]
            best = int(np.argmin(options))
            cost[k, j], choice[k, j] = options[best], prev[best]
    return [(float(cost[k, n - 1]), _backtrack(candidates, choice, k, n - 1)) for k in range(1, levels + 1)]


def _backtrack(candidates: np.ndarray, choice: np.ndarray, k: int, j: int) -> Buckets:
    picked = []
    while k >= 1:
        picked.append(int(candidates[j]))
        j, k = int(choice[k, j]), k - 1
    return tuple(reversed(picked))


@dataclass(frozen=True)
class Plan:
    """Buckets for the three dimensions, as engine options name them (context in tokens)."""

    prefill: Buckets
    rows: Buckets
    context: Buckets

    def options(self) -> Dict[str, Buckets]:
        """The engine options that serve these buckets."""
        return {"prefill_buckets": self.prefill, "decode_buckets": self.rows, "decode_context_buckets": self.context}

    @property
    def model_graphs(self) -> int:
        return len(self.prefill) + len(self.rows) * len(self.context)

    def wastes(self, dims: Dict[str, Dimension]) -> Dict[str, float]:
        return {"prefill": dims["prefill"].waste(self.prefill), "rows": dims["rows"].waste(self.rows),
                "context": dims["context"].waste(self.context)}


OptimalTables = Dict[str, List[Tuple[float, Buckets]]]


def optimal_tables(dims: Dict[str, Dimension], max_buckets: int) -> OptimalTables:
    """``optimal_buckets`` of every dimension, up to ``max_buckets`` each."""
    return {name: optimal_buckets(dim, max_buckets) for name, dim in dims.items()}


def split_budget(dims: Dict[str, Dimension], max_graphs: int, tables: Optional[OptimalTables] = None) -> Plan:
    """The optimal plan with at most ``max_graphs`` model graphs: the split of the budget whose
    worst dimension wastes least (ties: least total waste). ``tables`` (from
    ``optimal_tables`` with at least ``max_graphs`` buckets) saves recomputing them."""
    best = tables or optimal_tables(dims, max_graphs)
    found = None
    for r, c in itertools.product(range(1, len(best["rows"]) + 1), range(1, len(best["context"]) + 1)):
        p = min(max_graphs - r * c, len(best["prefill"]))
        if p < 1:
            continue
        plan = Plan(best["prefill"][p - 1][1], best["rows"][r - 1][1], best["context"][c - 1][1])
        wastes = plan.wastes(dims).values()
        key = (round(max(wastes), 12), sum(wastes), plan.model_graphs)
        if found is None or key < found[0]:
            found = (key, plan)
    if found is None:
        raise ValueError(f"max_graphs {max_graphs} is below the smallest plan (2 graphs: one prefill, one decode)")
    return found[1]


def recipe_plans(dims: Dict[str, Dimension]) -> Dict[str, Plan]:
    """Every fixed recipe's plan, named ``scheme`` or ``scheme:param``."""
    def plan(make) -> Plan:
        return Plan(*(make(dims[name].multiple, dims[name].top) for name in ("prefill", "rows", "context")))
    plans = {"pow2": plan(pow2_buckets)}
    for parts in (4, 8, 16):
        plans[f"gap:{parts}"] = plan(lambda m, t, parts=parts: gap_buckets(m, t, parts))
    for percent in (10, 25, 50):
        plans[f"pct:{percent}"] = plan(lambda m, t, percent=percent: percent_buckets(m, t, percent))
    return plans
