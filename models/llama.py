"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) over the paged attention ops.

Module and parameter names mirror Hugging Face's, so a checkpoint's tensor names map one to
one onto ``state_dict()`` keys and loading can check them strictly. Gemma and Gemma-2 reuse
these classes through the hooks marked below.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.attention import AttentionMetadata, paged_attention_forward
from models.layers.linear import Linear, VocabEmbedding
from models.layers.norm import RMSNorm
from models.layers.rotary import rope_from_config

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}

KVCache = Tuple[torch.Tensor, torch.Tensor]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    """Self-attention with GQA, RoPE and a paged KV cache."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        self.head_dim = head_dim_of(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rotary = rope_from_config(cfg, self.head_dim)
        # Hooks for Gemma-2; plain Llama uses 1/sqrt(head_dim), no soft-cap, no window.
        self.scale = self.head_dim ** -0.5
        self.soft_cap: Optional[float] = None
        self.sliding_window: Optional[int] = None

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(meta.positions, q, k)
        out = paged_attention_forward(q, k, v, kv_cache, meta, scale=self.scale,
                                      soft_cap=self.soft_cap, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    norm_unit_offset = False

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg, self.activation_of(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, self.norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, self.norm_unit_offset)

    @staticmethod
    def activation_of(cfg) -> str:
        return getattr(cfg, "hidden_act", None) or "silu"

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    layer_class = LlamaDecoderLayer

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.layer_class.norm_unit_offset)
        self.embed_scale: Optional[float] = None  # Gemma scales embeddings by sqrt(hidden)

    def forward(self, input_ids: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Causal LM head over ``LlamaModel``; ``forward`` returns hidden states, logits separate."""

    model_class = LlamaModel

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.final_logit_softcap: Optional[float] = None

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    def forward(self, input_ids: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = (hidden @ head).float()
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
