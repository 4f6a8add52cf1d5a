"""Speculative decoding with an EAGLE-3 head (native path): the head's drafts are those of an
independent implementation (transformers' attention, RoPE and norms over the target's hidden
states from transformers), and whatever it drafts, outputs equal those of decoding one token at
a time, through chunked prefill, preemption and every sampling feature. A random head proves
exactness and the loading of the published layout, not acceptance (no trained head installs here).
A head that does not fit the target fails at start-up naming the problem."""
import json
import random

import pytest
import torch

from tests.common import assert_same_outputs_over_random_requests, tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.engine.drafter import ModelDrafter
from tpu_executor.tools.eagle3_head import write_random_eagle3_head
from tpu_executor.tools.random_checkpoint import TINY, build

DRAFT_VOCAB = 300  # a subset of the tiny targets' 512 tokens: drafts map through d2t


def eagle3_config(head: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def heads(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {arch: write_random_eagle3_head(checkpoints[arch], str(root / arch), DRAFT_VOCAB)
            for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def engines(checkpoints, heads):
    """(plain, EAGLE-3) native engines with a small KV cache (requests get preempted) and a
    token budget of 64 (chunked prompts)."""
    options = tiny_engine_options(device="cpu", num_blocks=60, block_size=16, max_num_batched_tokens=64)
    pair = [LLM(model=checkpoints["llama"], **options),
            LLM(model=checkpoints["llama"], speculative_config=eagle3_config(heads["llama"]), **options)]
    yield pair
    for llm in pair:
        llm.shutdown()


def test_outputs_equal_plain_outputs_over_200_random_requests(engines):
    plain, eagle = engines
    assert_same_outputs_over_random_requests(plain, eagle)
    stats = eagle.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0
    eagle.engine.core.kv_cache.check_invariants()


class ReferenceHead:
    """The head computed with transformers' modules over the whole sequence at each step."""

    def __init__(self, target_dir: str, head_dir: str):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama import modeling_llama as hf

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        with open(f"{head_dir}/config.json") as f:
            self.cfg = json.load(f)
        w = load_file(f"{head_dir}/model.safetensors")
        cfg = LlamaConfig(**{k: v for k, v in self.cfg.items() if k != "architectures"})
        cfg._attn_implementation = "eager"
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn, self.mlp = hf.LlamaAttention(cfg, 0), hf.LlamaMLP(cfg)
        for name in ("q_proj", "k_proj", "v_proj"):  # the head's attention reads 2 * hidden inputs
            setattr(self.attn, name, torch.nn.Linear(2 * hidden, w[f"midlayer.self_attn.{name}.weight"].shape[0],
                                                     bias=False))
        self.norms = {n: hf.LlamaRMSNorm(hidden, eps) for n in ("input_layernorm", "hidden_norm",
                                                                "post_attention_layernorm", "norm")}
        modules = {"midlayer.self_attn": self.attn, "midlayer.mlp": self.mlp,
                   **{f"midlayer.{n}": m for n, m in self.norms.items() if n != "norm"}, "norm": self.norms["norm"]}
        for prefix, module in modules.items():
            module.load_state_dict({k[len(prefix) + 1:]: v for k, v in w.items() if k.startswith(prefix + ".")})
        self.rotary = hf.LlamaRotaryEmbedding(cfg)
        self.fc, self.lm_head, self.d2t = w["fc.weight"], w["lm_head.weight"], w["d2t"]

    @torch.no_grad()
    def drafts(self, token_ids, k: int):
        """The k drafts after ``token_ids`` (the target computed all but the last)."""
        out = self.target(torch.tensor([token_ids[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.cfg["eagle_aux_hidden_state_layer_ids"]], -1)
        hidden, tokens, drafts = aux @ self.fc.T, list(token_ids[1:]), []
        for _ in range(k):
            normed, prenorm = self._forward(torch.tensor(tokens), hidden)
            draft = int(torch.argmax(normed[-1] @ self.lm_head.T))
            drafts.append(draft + int(self.d2t[draft]))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, prenorm[-1:]])
        return tuple(drafts)

    def _forward(self, tokens, hidden):
        n = self.norms
        x = torch.cat([n["input_layernorm"](self.target.get_input_embeddings()(tokens)), n["hidden_norm"](hidden)], -1)
        positions = torch.arange(len(tokens))[None]
        mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
        attended = self.attn(x[None], self.rotary(x[None], positions), mask)[0][0]
        residual = hidden + attended
        prenorm = residual + self.mlp(n["post_attention_layernorm"](residual))
        return n["norm"](prenorm), prenorm


# Every path with a Llama target (the compiled ones: the hidden states copied out of the
# target's graphs, the head's catch-up and steps in graphs of the plan), Qwen3 natively.
@pytest.mark.parametrize("arch, device", [("llama", "cpu"), ("qwen3", "cpu"),
                                          pytest.param("llama", "xla", marks=pytest.mark.slow),
                                          pytest.param("llama", "jax", marks=pytest.mark.slow)])
def test_drafts_equal_an_independent_implementation(checkpoints, heads, arch, device, monkeypatch):
    proposals = {}
    propose = ModelDrafter.propose

    def recording(self, request, max_drafts):
        if request.drafted_at == request.num_tokens and request.request_id not in proposals:
            proposals[request.request_id] = (tuple(request.all_token_ids), request.drafts)
        return propose(self, request, max_drafts)

    monkeypatch.setattr(ModelDrafter, "propose", recording)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 40))] for _ in range(4)]
    # Prompts of up to 40 tokens in chunks of 16: the head's input at a chunk's last position is
    # the next chunk's first token.
    llm = LLM(model=checkpoints[arch], speculative_config=eagle3_config(heads[arch], k=4),
              **tiny_engine_options(device=device, block_size=16, max_num_batched_tokens=16, strict=True))
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=3),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    reference = ReferenceHead(checkpoints[arch], heads[arch])
    assert len(proposals) == len(prompts)
    first_drafts = [drafts for _, drafts in proposals.values()]
    assert len(set(first_drafts)) == len(prompts)  # drafts depend on the context
    for token_ids, drafts in proposals.values():
        assert drafts == reference.drafts(token_ids, 4)


@pytest.fixture(scope="module")
def bad_heads(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_heads")
    wide = build(str(root / "wide"), "llama", dict(TINY, hidden_size=96, head_dim=24))
    return {"hidden": write_random_eagle3_head(wide, str(root / "hidden")),
            "layers": write_random_eagle3_head(checkpoints["llama"], str(root / "layers"), aux_layer_ids=[0, 1, 5]),
            "not a head": checkpoints["mistral"]}


@pytest.mark.parametrize("problem, message", [
    ("hidden", "takes hidden states of size 96 .* the target's hidden size is 64"),
    ("layers", r"reads the target's layers \[0, 1, 5\].* of the 2 the target has"),
    ("not a head", "is not an EAGLE-3 head"),
])
def test_a_head_that_does_not_fit_the_target_is_refused(checkpoints, bad_heads, problem, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=checkpoints["llama"], speculative_config=eagle3_config(bad_heads[problem]),
            **tiny_engine_options(device="cpu"))


def test_start_up_report_names_the_head(engines, heads):
    from tpu_executor.engine.stats import startup_report

    _, eagle = engines
    report = startup_report(eagle.engine.config, eagle.stats(), 1.0)
    assert f"speculative decoding: eagle3, 3 draft tokens, EAGLE-3 head {heads['llama']}" in report
