"""Parallel layers, rank by rank in one process: every rank loads its shard of a real tiny
checkpoint, and the shards recombine (sum for row-parallel partial products, concatenation
for gathered logits) into exactly what the single-rank model computes."""
from __future__ import annotations

import pytest
import torch

from tpu_executor.models.layers.parallel import TensorParallelGroup, check_tensor_parallel, kv_heads_of_rank
from tpu_executor.worker.model_loader import load_model


class PartialGroup(TensorParallelGroup):
    """Rank ``rank`` of ``world_size`` whose collectives do nothing: layers return their
    rank's partial result, which the test combines across ranks itself."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x


def _rank_models(path, world_size):
    return [load_model(path, torch.float32, PartialGroup(r, world_size)) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_shards_sum_to_the_full_mlp(checkpoints, world_size):
    full = load_model(checkpoints["llama"], torch.float32)
    ranks = _rank_models(checkpoints["llama"], world_size)
    x = torch.randn(5, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = full.model.layers[1].mlp(x)
    partial = sum(m.model.layers[1].mlp(x) for m in ranks)
    torch.testing.assert_close(partial, expected, rtol=1e-5, atol=1e-5)


def test_qkv_shards_replicate_kv_heads_when_ranks_exceed_them(checkpoints):
    """4 query heads, 2 KV heads, 4 ranks: rank r holds query head r and KV head r // 2."""
    full = load_model(checkpoints["llama"], torch.float32).model.layers[0].self_attn
    d = full.head_dim
    x = torch.randn(3, full.qkv_proj.weight.shape[0], generator=torch.Generator().manual_seed(1))
    q, k, v = full.qkv_proj(x).split(full.qkv_proj.split_sizes, dim=-1)
    for rank, model in enumerate(_rank_models(checkpoints["llama"], 4)):
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        q_r, k_r, v_r = attn.qkv_proj(x).split(attn.qkv_proj.split_sizes, dim=-1)
        torch.testing.assert_close(q_r, q[:, rank * d:(rank + 1) * d])
        kv = rank // 2
        torch.testing.assert_close(k_r, k[:, kv * d:(kv + 1) * d])
        torch.testing.assert_close(v_r, v[:, kv * d:(kv + 1) * d])


@pytest.mark.parametrize("arch", ["llama", "gemma"])  # untied LM head / tied embeddings
def test_vocab_shards_rebuild_embeddings_and_logits(checkpoints, arch):
    full = load_model(checkpoints[arch], torch.float32)
    ranks = _rank_models(checkpoints[arch], 4)
    ids = torch.tensor([0, 3, 127, 128, 300, full.config.vocab_size - 1])
    embedded = sum(m.model.embed_tokens(ids) for m in ranks)
    torch.testing.assert_close(embedded, full.model.embed_tokens(ids))
    hidden = torch.randn(2, full.config.hidden_size, generator=torch.Generator().manual_seed(2))
    gathered = torch.cat([m.compute_logits(hidden) for m in ranks], dim=-1)
    torch.testing.assert_close(gathered, full.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def test_vocab_not_divisible_is_padded_and_cut():
    from tpu_executor.models.layers.linear import VocabParallelEmbedding

    table = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))  # HF layout [vocab, hidden]
    shards = []
    for rank in range(4):
        layer = VocabParallelEmbedding(10, 4, PartialGroup(rank, 4))
        layer.weight.weight_loader(layer.weight, table)
        shards.append(layer)
    assert shards[-1].weight[1:].abs().sum() == 0  # vocab 10 -> 12 rows, 2 of them padding
    ids = torch.arange(10)
    torch.testing.assert_close(sum(s(ids) for s in shards), table)


def test_kv_head_assignment():
    assert [kv_heads_of_rank(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_heads_of_rank(2, r, 8) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4
    with pytest.raises(ValueError, match="not a multiple"):
        kv_heads_of_rank(2, 0, 3)


def test_impossible_splits_name_the_field(checkpoints):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(checkpoints["llama"])  # 4 heads, 2 KV heads, intermediate 128
    check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by tensor_parallel_size 3"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tensor_parallel(cfg, 8)


def test_shard_loader_rejects_a_wrong_shape(checkpoints):
    model = load_model(checkpoints["llama"], torch.float32, PartialGroup(1, 2))
    param = model.model.layers[0].mlp.down_proj.weight
    with pytest.raises(ValueError, match="dimension 1 is 100"):
        param.weight_loader(param, torch.zeros(64, 100))
