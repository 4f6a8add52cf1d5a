"""SmolLM2-135M-Instruct (the default model): greedy tokens identical to transformers (fp32)
over 64 new tokens on a mixed-length batch on the native path (the compiled paths run the tiny
checkpoints of test_parity.py: SmolLM2's 30 layers take minutes to compile there); and real
text."""
import pytest

from tests.common import hf_greedy, mixed_prompts
from tpu_executor import LLM, SamplingParams

OPTIONS = dict(max_model_len=320, max_num_seqs=4, prefill_buckets=(64, 320), decode_buckets=(4,),
               decode_context_buckets=(320,), cache_dir=None, show_progress=False)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Mixed-length prompts and transformers' fp32 greedy tokens for them."""
    prompts = mixed_prompts(4, 16, 256, vocab=49152, seed=3)
    return prompts, hf_greedy(smollm2_path, prompts, 64)[0]


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_path, reference):
    prompts, expected = reference
    llm = LLM(model=smollm2_path, device="cpu", **OPTIONS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_matches_transformers(smollm2_path, reference, tmp_path, method):
    """N-gram drafts, and a draft model of SmolLM2's first 24 layers (it disagrees with the
    target on most tokens): the target's tokens all the same."""
    from tpu_executor.tools.layer_draft import write_layer_draft

    prompts, expected = reference
    speculative = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        speculative["model"] = write_layer_draft(smollm2_path, str(tmp_path / "draft"), 24)
    llm = LLM(model=smollm2_path, device="cpu", speculative_config=speculative, **OPTIONS)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        counts = llm.stats().spec_decode
        assert counts.num_drafts > 0 and counts.num_accepted_tokens < counts.num_draft_tokens
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_the_converted_checkpoint_is_a_plain_hugging_face_one(smollm2_path):
    """No GGUF quantization entry survives the conversion: tools that load the directory
    through transformers with options of their own (lm-eval) must find plain weights."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    with open(os.path.join(smollm2_path, "config.json")) as handle:
        assert "quantization_config" not in json.load(handle)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
