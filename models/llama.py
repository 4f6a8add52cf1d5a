"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) over the paged attention ops, and the
base the other families build on.

The block takes its differences from the config and a few hooks: biases (``biases``), per-head
q/k norms (``qk_norms``), the sliding window and RoPE of each layer (``layer_types``,
``sliding_window``, per-type RoPE parameters), norm placement and flavour (the decoder layer
classes). Module and parameter names mirror Hugging Face's, so a checkpoint's tensor names map
one to one onto ``state_dict()`` keys and loading can check them strictly.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from tpu_executor.kernels.act_and_mul.ops import act_and_mul
from tpu_executor.kernels.act_and_mul.reference import ACTIVATIONS
from tpu_executor.models.layers.attention import AttentionMetadata, paged_attention_forward
from tpu_executor.models.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tpu_executor.models.layers.norm import RMSNorm
from tpu_executor.models.layers.parallel import SingleRank, TensorParallelGroup
from tpu_executor.models.layers.rotary import rope_from_config

KVCache = Tuple[torch.Tensor, torch.Tensor]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_type_of(cfg, layer_idx: int) -> Optional[str]:
    """``full_attention`` or ``sliding_attention`` for configs that mark their layers, else None."""
    types = getattr(cfg, "layer_types", None)
    return types[layer_idx] if types else None


def sliding_window_of(cfg, layer_idx: int) -> Optional[int]:
    """Layer ``layer_idx``'s attention window: ``sliding_window`` on the layers ``layer_types``
    marks ``sliding_attention``, or on every layer of a config without ``layer_types``
    (Mistral); None where the config has no window."""
    window = getattr(cfg, "sliding_window", None)
    layer_type = layer_type_of(cfg, layer_idx)
    if window is None or layer_type not in (None, "sliding_attention"):
        return None
    return int(window)


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); gate and up in one column-parallel matmul,
    down row-parallel (one all-reduce)."""

    def __init__(self, cfg, activation: str, tp: TensorParallelGroup):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        bias = bool(getattr(cfg, "mlp_bias", False))
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], tp, bias=bias)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, tp, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora_slots)
        return self.down_proj(act_and_mul(gate_up, activation=self.activation), lora_slots)


class LlamaAttention(nn.Module):
    """Self-attention with GQA, RoPE and a paged KV cache, over this rank's heads: QKV
    column-parallel, the output projection row-parallel (one all-reduce)."""

    def __init__(self, cfg, layer_idx: int, tp: TensorParallelGroup):
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_key_value_heads}")
        self.head_dim = head_dim_of(cfg)
        qkv_bias, o_bias = self.biases(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, tp, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, tp, bias=o_bias)
        self.q_norm, self.k_norm = self.qk_norms(cfg)
        self.rotary = rope_from_config(cfg, self.head_dim, layer_type_of(cfg, layer_idx))
        self.sliding_window = sliding_window_of(cfg, layer_idx)
        # Gemma-2 and 3 change these two: scale from query_pre_attn_scalar, a logit soft-cap.
        self.scale = self.head_dim ** -0.5
        self.soft_cap: Optional[float] = None

    @staticmethod
    def biases(cfg) -> Tuple[bool, bool]:
        """(QKV bias, output bias): both ``attention_bias`` here; Qwen2 biases only QKV."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def qk_norms(self, cfg) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
        """Per-head norms of q and k before RoPE (Qwen3, Gemma-3); none here."""
        return None, None

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        q_size, kv_size, _ = self.qkv_proj.split_sizes
        qk, v = self.qkv_proj(x, meta.lora_slots).split([q_size + kv_size, kv_size], dim=-1)
        qk = qk.reshape(num_tokens, heads + kv_heads, self.head_dim)
        v = v.reshape(num_tokens, kv_heads, self.head_dim)
        if self.q_norm is None:  # q's heads and k's side by side: RoPE turns them in one go
            q, k = self.rotary.rotate(meta.positions, qk, shared=meta.rope).split([heads, kv_heads], dim=1)
        else:
            q, k = self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])
            q, k = self.rotary(meta.positions, q, k, shared=meta.rope)
        out = paged_attention_forward(q, k, v, kv_cache, meta, scale=self.scale,
                                      soft_cap=self.soft_cap, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim), meta.lora_slots)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (the add before the second
    norm runs inside it)."""

    norm_unit_offset = False

    def __init__(self, cfg, layer_idx: int, tp: TensorParallelGroup, attention_class: type = LlamaAttention):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = attention_class(cfg, layer_idx, tp)
        self.mlp = self.build_mlp(cfg, layer_idx, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, self.norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, self.norm_unit_offset)

    @staticmethod
    def activation_of(cfg) -> str:
        return getattr(cfg, "hidden_act", None) or "silu"

    def build_mlp(self, cfg, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (Mixtral and Qwen3-MoE swap in their
        mixtures of experts)."""
        return LlamaMLP(cfg, self.activation_of(cfg), tp)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), kv_cache, meta)
        normed, x = self.post_attention_layernorm(attended, residual=x)
        return x + self.mlp(normed, meta.lora_slots)


class LlamaModel(nn.Module):
    """Embedding, decoder layers (of ``layer_class`` with ``attention_class``), final norm."""

    def __init__(self, cfg, tp: TensorParallelGroup, layer_class: type = LlamaDecoderLayer,
                 attention_class: type = LlamaAttention):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layer_class(cfg, i, tp, attention_class) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, layer_class.norm_unit_offset)
        self.embed_scale: Optional[float] = None  # Gemma scales embeddings by sqrt(hidden)

    def forward(self, input_ids: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if meta.taps is not None:
                meta.taps.record(index, x)
            x = layer(x, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Causal LM head over ``LlamaModel``; ``forward`` returns hidden states, logits separate.

    Built for one rank of ``tp`` (default: the single-rank group). A family sets the classes
    it changes: ``model_class`` (the stack), ``layer_class`` (the block), ``attention_class``.
    ``packed_modules`` maps checkpoint module names onto the packed layers that hold them (and
    which shard).
    """

    model_class = LlamaModel
    layer_class = LlamaDecoderLayer
    attention_class = LlamaAttention
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, tp: Optional[TensorParallelGroup] = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or SingleRank()
        self.model = self.model_class(cfg, self.tp, self.layer_class, self.attention_class)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.final_logit_softcap: Optional[float] = None

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a part this model does not serve (a
        multimodal checkpoint's vision tower); everything else must load."""
        return False

    def checkpoint_target(self, name: str) -> Tuple[str, object]:
        """(parameter name, shard id) that checkpoint tensor ``name`` loads into:
        ``...q_proj.weight`` is shard ``"q"`` of ``...qkv_proj.weight``; others map one to one."""
        parts = name.split(".")
        for index, part in enumerate(parts):
            if part in self.packed_modules:
                module, shard_id = self.packed_modules[part]
                return ".".join(parts[:index] + [module] + parts[index + 1:]), shard_id
        return name, None

    @property
    def num_layers(self) -> int:
        """Decoder layers: one K/V cache pair each."""
        return len(self.model.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (its KV cache's head count)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    def forward(self, input_ids: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        logits = head.logits(hidden).float()
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
