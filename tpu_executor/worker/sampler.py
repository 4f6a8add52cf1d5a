"""On-device sampler in fixed shapes: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Random draws use the Gumbel-max trick with noise from a counter-based hash of
(request seed, output position, token id). A seeded request therefore samples the same tokens
whatever else is in its batch and whichever bucket pads it, and no RNG state lives on device.
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


def _filtered_sorted_logits(logits, temperature, top_k, top_p, min_p):
    """Temperature-scaled logits sorted descending, with filtered-out entries at -inf."""
    vocab_size = logits.shape[-1]
    safe_temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    sorted_logits, sorted_ids = torch.sort(logits / safe_temp[:, None], dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size))
    keep = ranks < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # Nucleus: keep a token if the mass strictly before it is below top_p (the first always stays).
    keep = keep & ((torch.cumsum(probs, dim=-1) - probs) < top_p[:, None])
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    return sorted_logits.masked_fill(~keep, float("-inf")), sorted_ids


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
           num_logprobs: int, all_greedy: bool, choice_logits: Optional[torch.Tensor] = None) -> SamplerOutput:
    """Sample one token per row of ``logits [B, V]`` (fp32).

    Rows with ``temperature == 0`` are greedy. ``all_greedy`` (a Python constant, so it picks a
    separate compiled graph) skips the sort and the noise when no row samples. The tokens are
    picked from ``choice_logits`` when given (the processed logits); log-probs are always those
    of the model's own ``logits``, as vLLM reports them by default.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    if choice_logits is not None:
        logits = choice_logits
    token_ids = torch.argmax(logits, dim=-1)
    if not all_greedy:
        filtered, sorted_ids = _filtered_sorted_logits(logits, temperature, top_k, top_p, min_p)
        noise = gumbel_noise(seeds, steps, logits.shape[-1]).gather(1, sorted_ids)
        choice = torch.argmax(filtered + noise, dim=-1, keepdim=True)
        sampled = sorted_ids.gather(1, choice).squeeze(1)
        token_ids = torch.where(temperature > 0, sampled, token_ids)
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if num_logprobs == 0:
        return SamplerOutput(token_ids, token_logprobs, None, None)
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_logprobs)
