"""On-device sampler in fixed shapes: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Random draws use the Gumbel-max trick with noise from a counter-based hash of
(request seed, output position, token id). A seeded request therefore samples the same tokens
whatever else is in its batch and whichever bucket pads it, and no RNG state lives on device.

No compiled graph sorts the vocabulary. Each filter keeps a prefix of the rows' tokens in descending order
of their temperature-scaled logits, ties lowest token id first (a stable sort's order), and the
end of that prefix is found by bisection over the unsorted vocabulary: 32 steps over the
order-preserving int32 image of the float32 values find the boundary value exactly, and a
second search over token ids (17 steps for 128K tokens) finds how many of the tokens tied at it
stay. Top-k keeps the first ``k``; top-p, over the probabilities after top-k, keeps a token iff
the mass of the tokens before it is below ``top_p`` (``top_p >= 1`` keeps every token); min-p
keeps a token iff its probability is at least ``min_p`` times the largest. Every step is a
masked count or sum over ``[B, V]`` in fixed shapes. Eager torch on a CPU or GPU (the native
path) finds the same set by a stable sort, which it runs faster (``_filtered_logits_by_sort``).

Rounding: the mass before a token is a masked float32 sum here, where a sort form takes a
cumulative sum, and the softmax's denominator is summed in another order; the two can differ in
the last bits, so a token whose mass before lies within a few ulps of ``top_p`` (or whose
probability lies that close to the min-p bound) could be kept by one and not the other (the
tests count none over 9,000 tie-heavy random rows). A sort form's float32 cumulative sum also
reaches 1.0 before the tail of a peaked row and drops tail tokens at ``top_p = 1``, which keeps
every token here.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

_MASK32 = 0xFFFFFFFF


class SamplerOutput(NamedTuple):
    """Sampled ids ``[B]``, their log-probs ``[B]`` and the top-N ``[B, N]`` (None if N == 0).
    A named tuple: a pytree node for ``jax.jit`` as for torch.compile."""

    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    top_ids: Optional[torch.Tensor]
    top_logprobs: Optional[torch.Tensor]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, V]`` determined by each row's (seed, step) and the token id."""
    key = _mix32((seeds & _MASK32) ^ _mix32((seeds >> 32) & _MASK32))
    key = _mix32(key ^ _mix32(steps & _MASK32))
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(key[:, None] ^ ((token_ids * 0x9E3779B1) & _MASK32)[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # The top 24-bit value plus a half rounds to 1.0 in fp32, whose noise is +inf: added to a
    # filtered-out token's -inf it made NaN, which argmax picks (about once in 30,000 rows).
    uniform = torch.clamp(uniform, max=1.0 - 2.0 ** -24)
    return -torch.log(-torch.log(uniform))


# The steps of a search over int32 keys (32: one per bit, so it ends on a key exactly): the
# search starts at the smallest int32; the first step clears the sign bit, each later one sets
# one lower bit.
_INT32_MIN = -(1 << 31)
_KEY_STEPS = (_INT32_MIN,) + tuple(1 << bit for bit in range(30, -1, -1))


def _order_keys(values: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the float32 ``values``: their bits, with the low 31 flipped for
    negative floats (larger negatives first), and -0.0 keyed as 0.0 (they tie).

    The bits are assembled by arithmetic, every step exact, because neither torch_xla nor
    torchax lowers a bitcast into the graph (``view(torch.int32)`` and ``frexp`` run on the host
    under torch_xla; torchax takes the view for a reshape). Scaling a size into [1, 2) by powers
    of two gives its exponent, and the scaled size times 2**23 its mantissa bits. Subnormals come
    out exact in eager torch; XLA flushes them to zero, so there they tie with 0.0."""
    size = values.abs()
    small = size < 1.0
    lifted = torch.where(small, size * 2.0 ** 126, size)  # [2**-126, 1) onto [1, 2**126)
    exponent = small.to(torch.int32) * -126
    scaled = lifted
    for shift in (64, 32, 16, 8, 4, 2, 1):
        big = scaled >= 2.0 ** shift
        scaled = torch.where(big, scaled * 2.0 ** -shift, scaled)
        exponent = exponent + big.to(torch.int32) * shift
    # size = scaled * 2**exponent with scaled in [1, 2): biased exponent, then mantissa bits.
    bits = (exponent + 126) * (1 << 23) + (scaled * float(1 << 23)).to(torch.int32)
    subnormal = (lifted * float(1 << 23)).to(torch.int32)  # size * 2**149: the bits themselves
    bits = torch.where(size < 2.0 ** -126, subnormal, bits)
    bits = torch.where(torch.isinf(size), torch.full_like(bits, 0x7F800000), bits)
    return torch.where(values < 0, -1 - bits, bits)


def _largest(holds, start: torch.Tensor, steps) -> torch.Tensor:
    """Per row the largest ``t`` with ``holds(t)``, built one bit at a time from the top.
    ``holds`` must be true below any ``t`` where it is true, and true at ``start`` (the answer
    when it holds nowhere above). A fixed number of steps: no data-dependent control flow."""
    found = start
    for step in steps:
        trial = found ^ step
        found = torch.where(holds(trial), trial, found)
    return found


def _id_steps(vocab_size: int):
    """The search steps over token-id cut-offs ``0 .. 2**bits - 1`` (at least ``vocab_size``)."""
    return tuple(1 << bit for bit in range(vocab_size.bit_length() - 1, -1, -1))


def _top_k_mask(keys: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The first ``top_k`` tokens of each row in descending order, ties kept lowest id first."""
    vocab_size = keys.shape[-1]
    k = torch.where(top_k > 0, torch.clamp(top_k, max=vocab_size), torch.full_like(top_k, vocab_size))
    k = k.to(torch.int32)[:, None]

    def count(mask):
        return mask.sum(-1, keepdim=True, dtype=torch.int32)

    lowest = torch.full_like(k, _INT32_MIN)
    kth = _largest(lambda t: count(keys >= t) >= k, lowest, _KEY_STEPS)  # the k-th largest key
    tied_ids = _tied_ids(keys, ids, kth)
    room = k - count(keys > kth)  # how many of the tied tokens fit
    cut = _largest(lambda c: count(tied_ids < c) <= room, torch.zeros_like(k), _id_steps(vocab_size))
    return (keys > kth) | (tied_ids < cut)


def _tied_ids(keys: torch.Tensor, ids: torch.Tensor, boundary: torch.Tensor) -> torch.Tensor:
    """The ids of the tokens whose key is ``boundary``; the others get one no cut-off reaches."""
    return torch.where(keys == boundary, ids, torch.full_like(ids, torch.iinfo(torch.int32).max))


def _top_p_mask(keys: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus: a token stays iff the mass of the tokens before it in descending order
    (ties lowest id first) is below ``top_p``. ``top_p >= 1`` keeps every token."""
    p = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf")))[:, None]

    def mass(mask):
        return torch.where(mask, probs, 0.0).sum(-1, keepdim=True)

    lowest = torch.full_like(keys[:, :1], _INT32_MIN)
    # The edge: the largest key where the mass from the top reaches top_p. Every larger key
    # stays, every smaller one goes; of the tokens at the edge, those whose mass before is below
    # top_p (the mass above plus their tied predecessors'; the first always, as the mass above
    # the edge is below top_p).
    edge = _largest(lambda t: mass(keys >= t) >= p, lowest, _KEY_STEPS)
    above, tied_ids = keys > edge, _tied_ids(keys, ids, edge)
    mass_above = mass(above)
    last = _largest(lambda c: mass_above + mass(tied_ids < c) < p, torch.zeros_like(edge),
                    _id_steps(keys.shape[-1]))
    return above | (tied_ids <= last)


def _temperature_scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Logits over each row's temperature (greedy rows, at 0, unscaled)."""
    return logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]


def _filtered_logits(logits, temperature, top_k, top_p, min_p):
    """Temperature-scaled logits ``[B, V]`` with the tokens top-k, top-p and min-p filter out at
    -inf, in token-id order (no sort: each boundary found by search, see the module docstring)."""
    scaled = _temperature_scaled(logits, temperature)
    keys = _order_keys(scaled)
    ids = torch.arange(scaled.shape[-1], device=scaled.device, dtype=torch.int32)[None, :]
    keep = _top_k_mask(keys, ids, top_k)
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & _top_p_mask(keys, ids, probs, top_p)
    keep = keep & (probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values)
    return scaled.masked_fill(~keep, float("-inf"))


def _filtered_logits_by_sort(logits, temperature, top_k, top_p, min_p):
    """``_filtered_logits``'s kept set found by a stable sort of each row: eager torch on a CPU
    or GPU sorts a row several times faster than it makes the searches' hundred passes over it
    (a compiler is the other way round: libtpu took 245 s to compile the sort at a 128K
    vocabulary, 13 s the searches)."""
    vocab_size = logits.shape[-1]
    scaled = _temperature_scaled(logits, temperature)
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size))
    keep = torch.arange(vocab_size, device=logits.device)[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & (((torch.cumsum(probs, dim=-1) - probs) < top_p[:, None]) | (top_p >= 1)[:, None])
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    kept = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_ids, kept)


def _sorting_is_cheaper(logits: torch.Tensor) -> bool:
    """Eager torch on a CPU or GPU (the native path), not a graph traced for a compiler."""
    return logits.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling()


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
           num_logprobs: int, all_greedy: bool, choice_logits: Optional[torch.Tensor] = None) -> SamplerOutput:
    """Sample one token per row of ``logits [B, V]`` (fp32).

    Rows with ``temperature == 0`` are greedy. ``all_greedy`` (a Python constant, so it picks a
    separate compiled graph) skips the filters and the noise when no row samples. A sampled
    row takes the argmax of its filtered logits plus each token id's own noise. The tokens are
    picked from ``choice_logits`` when given (the processed logits); log-probs are always those
    of the model's own ``logits``, as vLLM reports them by default.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    if choice_logits is not None:
        logits = choice_logits
    token_ids = torch.argmax(logits, dim=-1)
    if not all_greedy:
        choose = _filtered_logits_by_sort if _sorting_is_cheaper(logits) else _filtered_logits
        filtered = choose(logits, temperature, top_k, top_p, min_p)
        sampled = torch.argmax(filtered + gumbel_noise(seeds, steps, logits.shape[-1]), dim=-1)
        token_ids = torch.where(temperature > 0, sampled, token_ids)
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if num_logprobs == 0:
        return SamplerOutput(token_ids, token_logprobs, None, None)
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_logprobs)
