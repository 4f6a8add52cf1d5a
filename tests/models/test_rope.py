"""RoPE of every supported type rotates q and k exactly as transformers' own rotary embedding
and ``apply_rotary_pos_emb`` do for the same config (fp32), Gemma-3's per-layer-type
parameters included; an unsupported type is refused at start-up with the supported list."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tpu_executor.models.layers.rotary import SUPPORTED_ROPE_TYPES, rope_from_config

HEAD_DIM, HEADS, MAX_POSITIONS = 64, 4, 4096
BASE = dict(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
            max_position_embeddings=MAX_POSITIONS)
CONFIGS = {
    "default": lambda: tf.LlamaConfig(**BASE, rope_theta=10000.0),
    "linear": lambda: tf.LlamaConfig(**BASE, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    "dynamic": lambda: tf.LlamaConfig(**BASE, rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                                   rope_theta=10000.0)),
    "yarn": lambda: tf.Qwen3Config(**BASE, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6,
                                                                original_max_position_embeddings=1024)),
    "llama3": lambda: tf.LlamaConfig(**BASE, rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=500000.0,
        original_max_position_embeddings=1024)),
}
ROTARY_CLASS = {"Qwen3Config": tf.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding}


def rotated_by_transformers(rotary, positions, q, k, **kwargs):
    cos, sin = rotary(q, positions[None], **kwargs)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


def random_qk(tokens: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(tokens, HEADS, HEAD_DIM, generator=gen), torch.randn(tokens, 2, HEAD_DIM, generator=gen)


def test_every_supported_type_is_covered():
    assert set(CONFIGS) == set(SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize("rope_type", sorted(CONFIGS))
def test_rotation_equals_transformers(rope_type):
    config = CONFIGS[rope_type]()
    rotary = ROTARY_CLASS.get(type(config).__name__, tf.models.llama.modeling_llama.LlamaRotaryEmbedding)(config)
    # Positions across the whole served range (dynamic NTK changes nothing below the checkpoint's limit).
    positions = torch.tensor([0, 1, 7, 255, 1023, 1024, 2047, 3000, MAX_POSITIONS - 1])
    q, k = random_qk(len(positions))
    ours = rope_from_config(config, HEAD_DIM)(positions, q, k)
    for mine, theirs in zip(ours, rotated_by_transformers(rotary, positions, q, k)):
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma3_layer_types_have_their_own_parameters(layer_type):
    rope = {"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}
    config = tf.Gemma3TextConfig(**BASE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                 rope_parameters=rope)
    rotary = tf.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    positions = torch.tensor([0, 3, 100, 2000])
    q, k = random_qk(len(positions))
    ours = rope_from_config(config, HEAD_DIM, layer_type)(positions, q, k)
    for mine, theirs in zip(ours, rotated_by_transformers(rotary, positions, q, k, layer_type=layer_type)):
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-5)


def test_an_unsupported_type_is_refused_at_start_up_naming_the_supported_ones(checkpoints, tmp_path):
    from tpu_executor import LLM

    path = tmp_path / "longrope"
    shutil.copytree(checkpoints["llama"], path)
    config = json.loads((path / "config.json").read_text())
    half = config["head_dim"] // 2
    config["rope_parameters"] = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * half,
                                     long_factor=[2.0] * half, original_max_position_embeddings=512)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported; supported: default, linear, "
                                         "dynamic, yarn, llama3"):
        LLM(str(path), device="cpu")


def test_layers_with_equal_frequencies_share_one_cos_sin_per_step():
    """The step's dict holds one cos/sin per set of frequencies; the rotation is the same as
    without it, and q's and k's heads turned side by side equal q and k turned apart."""
    positions = torch.tensor([0, 5, 17, 300])
    q, k = random_qk(len(positions))
    first, second = (rope_from_config(CONFIGS["default"](), HEAD_DIM) for _ in range(2))
    other = rope_from_config(CONFIGS["llama3"](), HEAD_DIM)
    shared = {}
    expected = first(positions, q, k)
    for rotary in (first, second):
        for mine, theirs in zip(rotary(positions, q, k, shared=shared), expected):
            torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    assert len(shared) == 1
    other(positions, q, k, shared=shared)
    assert len(shared) == 2
    side_by_side = second.rotate(positions, torch.cat([q, k], dim=1), shared=shared)
    torch.testing.assert_close(side_by_side, torch.cat(expected, dim=1), atol=0, rtol=0)
