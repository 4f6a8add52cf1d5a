"""Rotary position embedding (Neox/Hugging Face "rotate half" layout) and its scaling types.

The frequencies of a scaled type come from transformers' own functions
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS``), so they are the checkpoint's by construction;
this module applies them. ``dynamic`` (NTK) rescales only beyond the checkpoint's
``max_position_embeddings``, which is also the longest context the engine serves, so there it
equals the default frequencies, as in transformers. Any other type is refused at start-up.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from tpu_executor.kernels.binding import eager_only
from tpu_executor.kernels.rotary_embedding.ops import rotary_embedding

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions (a device tensor, never a constant).
    ``attention_scaling`` multiplies cos and sin (YaRN's attention factor; 1 otherwise)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(attention_scaling)
        # Layers with equal frequencies share one cos/sin per step (see forward).
        self.frequencies_key = (tuple(self.inv_freq.tolist()), self.attention_scaling)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                shared: Optional[Dict] = None):
        """q [T, heads, d], k [T, kv_heads, d] -> rotated (same shapes and dtype)."""
        cos, sin = self.step_cos_sin(positions, shared)
        return rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, shared: Optional[Dict] = None) -> torch.Tensor:
        """x [T, heads, d] (any heads: q's and k's side by side) -> rotated."""
        return rotary_embedding(x, *self.step_cos_sin(positions, shared))

    def step_cos_sin(self, positions: torch.Tensor, shared: Optional[Dict]) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions``. ``shared``: the step's dict in which the first layer
        leaves them for the next layers with the same frequencies (untraced calls only: a
        traced graph computes them once anyway, and its inputs must not carry its values out)."""
        if shared is None or not eager_only(positions):
            return self.cos_sin(positions)
        if self.frequencies_key not in shared:
            shared[self.frequencies_key] = self.cos_sin(positions)
        return shared[self.frequencies_key]

    def cos_sin(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, d]`` of every position's angles."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin


def per_type_key(hf_config, layer_type: Optional[str]) -> Optional[str]:
    """``layer_type`` if the config has RoPE parameters per layer type (as Gemma-3's), else None."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return layer_type if layer_type is not None and isinstance(params.get(layer_type), dict) else None


def rope_parameters(hf_config, layer_type: Optional[str] = None) -> Dict:
    """The RoPE parameters of a transformers config for the layers of ``layer_type``
    (``rope_parameters``, or the legacy ``rope_scaling`` and ``rope_theta``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    key = per_type_key(hf_config, layer_type)
    if key is not None:
        params = dict(params[key])
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def check_rope(hf_config) -> None:
    """Refuse, before any worker starts, a checkpoint whose RoPE type (of any layer type) is
    not one of ``SUPPORTED_ROPE_TYPES``; the message names the type and the supported list."""
    for layer_type in set(getattr(hf_config, "layer_types", None) or [None]):
        rope_type = rope_parameters(hf_config, layer_type)["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def rope_frequencies(hf_config, head_dim: int, layer_type: Optional[str] = None) -> Tuple[torch.Tensor, float]:
    """(inverse frequencies ``[head_dim / 2]``, attention scaling) of the checkpoint's RoPE; a
    type other than ``SUPPORTED_ROPE_TYPES`` raises a ValueError naming it."""
    check_rope(hf_config)
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    # On the CPU even while a model is built on the meta device: the frequencies are the
    # config's (a few numbers), and equal ones are shared between layers (``frequencies_key``).
    with torch.device("cpu"):
        if rope_type == "default":
            theta = float(params["rope_theta"])
            return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu",
                                                           layer_type=per_type_key(hf_config, layer_type))
    return inv_freq, float(scaling)


def rope_from_config(hf_config, head_dim: int, layer_type: Optional[str] = None) -> RotaryEmbedding:
    """RoPE for the layers of ``layer_type`` (None: the model's one kind) of a checkpoint."""
    return RotaryEmbedding(*rope_frequencies(hf_config, head_dim, layer_type))
