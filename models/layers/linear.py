"""Linear and embedding layers that keep weights in ``[in, out]`` layout.

XLA's CPU backend materialises the transpose of ``x @ W.T`` on every call (measured: the
SmolLM2 LM head takes 122 ms that way and 8 ms with a pre-transposed weight), so matmul
weights are stored transposed once at load time. Each parameter carries a ``weight_loader``
that takes the checkpoint tensor in Hugging Face layout and writes it in ours.
"""
from __future__ import annotations

import torch
from torch import nn


def copy_weight(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Default loader: the checkpoint tensor has our layout."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


def copy_transposed(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader for ``[in, out]`` weights from Hugging Face's ``[out, in]``."""
    copy_weight(param, loaded.t())


def weight_loader(param: torch.Tensor):
    return getattr(param, "weight_loader", copy_weight)


class Linear(nn.Module):
    """``y = x @ W + b`` with ``W`` stored ``[in_features, out_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.weight.weight_loader = copy_transposed
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding stored ``[hidden, vocab]`` so a tied LM head is a plain ``h @ W``;
    lookups gather columns."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, vocab_size))
        self.weight.weight_loader = copy_transposed

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(1, token_ids).t()
