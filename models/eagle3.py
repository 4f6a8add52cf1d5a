"""EAGLE-3 draft head in the layout the published heads use (vLLM's ``LlamaForCausalLMEagle3``).

One Llama decoder layer (``midlayer``) whose attention reads the concatenation of the normed
token embedding and the normed hidden state (``2 * hidden_size`` inputs), its own final norm
and LM head over a draft vocabulary (``draft_vocab_size``; ``d2t[i]`` is the offset from draft
id ``i`` to its target id), and ``fc``, which folds three of the target's hidden states (the
residual stream entering the layers ``aux_layer_ids`` names) into one. The token embedding is
the target's unless the checkpoint carries its own.

At a position ``p`` the head takes the target's hidden state at ``p`` (through ``fc``) or, on
later draft steps, its own pre-norm output at ``p - 1``, with the token at ``p + 1``, and
predicts the token at ``p + 2``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from tpu_executor.models.layers.attention import AttentionMetadata
from tpu_executor.models.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    VocabParallelEmbedding,
)
from tpu_executor.models.layers.norm import RMSNorm
from tpu_executor.models.layers.parallel import SingleRank, TensorParallelGroup
from tpu_executor.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of

ARCHITECTURE = "LlamaForCausalLMEagle3"


class Eagle3Attention(LlamaAttention):
    """Llama attention whose QKV projection reads ``[embedding, hidden]`` (twice the width)."""

    def __init__(self, cfg, layer_idx: int, tp: TensorParallelGroup):
        super().__init__(cfg, layer_idx, tp)
        qkv_bias, _ = self.biases(cfg)
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, tp, bias=qkv_bias)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over the normed embedding and hidden state side by
    side, the hidden state as the residual (or its normed form, ``norm_before_residual``)."""

    def __init__(self, cfg, tp: TensorParallelGroup):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Eagle3Attention(cfg, 0, tp)
        self.mlp = LlamaMLP(cfg, getattr(cfg, "hidden_act", None) or "silu", tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it)."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        attended = self.self_attn(x, kv_cache, meta)
        normed, residual = self.post_attention_layernorm(attended, residual=residual)
        return self.mlp(normed), residual


class Eagle3Head(nn.Module):
    """An EAGLE-3 head for one rank of ``tp`` over ``target`` (a loaded target model).

    ``forward`` gives (normed, pre-norm) hidden states; ``draft_tokens`` the greedy target ids
    from normed ones; ``combine`` folds the target's three hidden states into one.
    """

    def __init__(self, cfg, target: LlamaForCausalLM, tp: Optional[TensorParallelGroup] = None,
                 own_embedding: bool = False):
        super().__init__()
        tp = tp or SingleRank()
        self.tp = tp
        self.config = cfg
        self.aux_layer_ids = aux_layer_ids(cfg, target.num_layers)
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        target_hidden = int(getattr(cfg, "target_hidden_size", None) or cfg.hidden_size)
        self.midlayer = Eagle3Layer(cfg, tp)
        # Small and read by every rank whole: replicated, not split.
        self.fc = ColumnParallelLinear(3 * target_hidden, cfg.hidden_size, SingleRank())
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, cfg.hidden_size, tp)
        if self.draft_vocab_size != cfg.vocab_size:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        else:  # the target's, not a parameter of the head (loaded and placed with the target)
            self._target_embedding = (target.model.embed_tokens,)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if "embed_tokens" in self._modules else self._target_embedding[0]
        return embedding(token_ids)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """``t2d`` (target-to-draft mask) is only used in training."""
        return name == "t2d"

    def checkpoint_target(self, name: str) -> Tuple[str, object]:
        """Checkpoint names map as the Llama decoder's (q/k/v and gate/up packed)."""
        return LlamaForCausalLM.checkpoint_target(self, name)

    packed_modules = LlamaForCausalLM.packed_modules

    @property
    def num_layers(self) -> int:
        """One K/V cache pair."""
        return 1

    @property
    def num_kv_heads(self) -> int:
        return self.midlayer.self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states ``[T, 3 * target_hidden]`` as one ``[T, hidden]``."""
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> Tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden states for the LM head, pre-norm ones for the next draft step)."""
        out, residual = self.midlayer(self.embed(input_ids), hidden, kv_caches[0], meta)
        return self.norm(out, residual=residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row, as a target id."""
        draft_ids = self.lm_head.logits(normed).argmax(-1)
        return draft_ids + self.d2t[draft_ids] if "d2t" in self._parameters else draft_ids


def aux_layer_ids(cfg, num_target_layers: int) -> Tuple[int, ...]:
    """The target layers whose input the head reads: the config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), else vLLM's
    default (layer 2, the middle one, the third from last)."""
    ids = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or \
        (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"the EAGLE-3 head reads the target's layers {list(ids)}, but an EAGLE-3 head takes "
                         f"three layers of the {num_target_layers} the target has; set "
                         "eagle_aux_hidden_state_layer_ids in the head's config.json")
    return ids
