"""Mixtral's mixture-of-experts block: the grouped path against the einsum reference, expert
weights loaded from w1/w2/w3 into the stacked layout, and no recompilation over random
lengths. (Greedy parity with transformers is in test_parity.py.)"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.common import tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.models.layers.moe import moe_reference, route, sparse_moe
from tpu_executor.worker.model_loader import load_model


@pytest.fixture(autouse=True, scope="module")
def registered_ops():
    from tpu_executor.kernels import register_all

    register_all()


def _moe_inputs(tokens: int, experts: int = 8, hidden: int = 32, inter: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    w13 = torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, inter, hidden, generator=gen) / inter ** 0.5
    return x, logits, w13, w2


@pytest.mark.parametrize("tokens", [1, 3, 8, 50, 300])  # row padding: 2, 6, 16, 100, 600 rows
def test_grouped_moe_equals_the_einsum_reference(tokens):
    x, logits, w13, w2 = _moe_inputs(tokens)
    torch.testing.assert_close(sparse_moe(x, logits, w13, w2, 2, F.silu),
                               moe_reference(x, logits, w13, w2, 2, F.silu), rtol=1e-5, atol=1e-5)


def test_routing_weights_are_the_renormalised_top_k_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, experts = route(logits, 2)
    assert experts.tolist() == [[3, 2]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights, (e / e.sum())[None])


def test_expert_tensors_load_into_the_stacked_layout(checkpoints):
    from safetensors import safe_open

    model = load_model(checkpoints["mixtral"], torch.float32)
    experts = model.model.layers[1].mlp.experts
    inter = experts.local
    with safe_open(f"{checkpoints['mixtral']}/model.safetensors", framework="pt") as f:
        prefix = "model.layers.1.block_sparse_moe.experts.5"
        torch.testing.assert_close(experts.w13[5, :, :inter], f.get_tensor(f"{prefix}.w1.weight").t())
        torch.testing.assert_close(experts.w13[5, :, inter:], f.get_tensor(f"{prefix}.w3.weight").t())
        torch.testing.assert_close(experts.w2[5], f.get_tensor(f"{prefix}.w2.weight").t())


@pytest.mark.slow
def test_no_recompilation_across_random_lengths(checkpoints):
    llm = LLM(checkpoints["mixtral"], **tiny_engine_options(strict=True))
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 250))]}
               for _ in range(40)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.engine.stats().graphs_compiled_after_warmup == 0
