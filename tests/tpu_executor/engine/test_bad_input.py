"""Bad input gets a clear error and the engine keeps serving everyone else."""
import os
import shutil

import pytest

from tests.common import POISON_ALL_RANKS, engine_with_worker, faulty_worker_class, run_to_end, tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.worker.model_loader import CheckpointError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(model=checkpoints["llama"], device="cpu", **tiny_engine_options())


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": list(range(3, 400))}, GREEDY, "max_model_len"),
    ({"prompt_token_ids": []}, GREEDY, "empty"),
    ("", GREEDY, "empty"),
    ({"prompt_token_ids": [5, 99999, 7]}, GREEDY, "outside the vocabulary"),
    ({"prompt_token_ids": [5, -1]}, GREEDY, "outside the vocabulary"),
    ({"tokens": [5]}, GREEDY, "prompt must be"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=1000), "logprobs"),
])
def test_bad_request_is_rejected_and_others_still_run(llm, prompt, params, message):
    good = {"prompt_token_ids": [5, 6, 7, 8]}
    expected = llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], [GREEDY, params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def past_the_bounds(**fields) -> SamplingParams:
    """Greedy parameters with ``fields`` set past SamplingParams' own checks (as a bug in them
    would let through): what the admission-time row check must still stop."""
    params = SamplingParams(temperature=0.5, max_tokens=8, ignore_eos=True, presence_penalty=0.5)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("fields, message", [
    ({"top_k": 2**70}, "top_k"),
    ({"temperature": 1e39}, "temperature"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # the second sample's seed is one past int64
    ({"min_tokens": 2**70}, "logits processing"),
])
def test_a_row_the_sampler_cannot_hold_fails_its_request_alone_at_admission(llm, fields, message):
    good = {"prompt_token_ids": [5, 6, 7, 8]}
    engine = llm.engine
    running = engine.add_request(good, GREEDY)
    outputs = engine.step()  # the good request is running when the bad one arrives
    with pytest.raises(ValueError, match=message):
        engine.add_request({"prompt_token_ids": [9, 10]}, past_the_bounds(**fields))
    finals = [o for o in outputs + run_to_end(engine) if o.request_id == running]
    assert finals[-1].finished and finals[-1].error is None
    assert sum(len(o.outputs[0].token_ids) for o in finals) == 8
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0


def test_failing_step_fails_only_its_requests(checkpoints):
    """An exception inside the worker's step fails that step's requests; the engine serves on."""
    engine = engine_with_worker(checkpoints["llama"], faulty_worker_class(), device="cpu", **tiny_engine_options())
    healthy = engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()  # the healthy request is now decoding
    doomed = engine.add_request({"prompt_token_ids": [9, POISON_ALL_RANKS, 11]}, GREEDY)
    outputs = {}  # healthy decodes and doomed prefills in one step (read back a call later when async)
    while doomed not in outputs:
        outputs.update({o.request_id: o for o in engine.step()})
    assert "device fell over" in outputs[doomed].error
    assert outputs[doomed].outputs[0].finish_reason == "error" and outputs[doomed].finished
    # The healthy request was in the failed step too: it fails, and the engine still serves.
    assert outputs[healthy].outputs[0].finish_reason == "error"
    again = engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    finals = [o for o in run_to_end(engine) if o.request_id == again]
    assert sum(len(o.outputs[0].token_ids) for o in finals) == 8 and finals[-1].error is None
    assert engine.stats().kv_blocks_used == 0


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_and_corrupt_checkpoints_fail_at_startup(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(model=str(tmp_path / "nowhere"), device="cpu")
    no_weights = _copy(checkpoints["llama"], tmp_path / "no_weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(model=no_weights, device="cpu", **tiny_engine_options())
    corrupt = _copy(checkpoints["llama"], tmp_path / "corrupt")
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError, match="corrupt"):
        LLM(model=corrupt, device="cpu", **tiny_engine_options())
    no_config = _copy(checkpoints["llama"], tmp_path / "no_config")
    os.remove(os.path.join(no_config, "config.json"))
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(model=no_config, device="cpu", **tiny_engine_options())


def test_wrong_tensor_names_are_listed(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    renamed = _copy(checkpoints["llama"], tmp_path / "renamed")
    path = os.path.join(renamed, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.weight_typo"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="q_proj.weight_typo"):
        LLM(model=renamed, device="cpu", **tiny_engine_options())


@pytest.mark.parametrize("options, message", [
    (dict(block_size=12), "block_size"),
    (dict(prefill_buckets=(24, 320)), "multiples of block_size"),
    (dict(max_num_batched_tokens=100, enable_chunked_prefill=False), "enable chunked prefill"),
    (dict(max_num_batched_tokens=4), "below max_num_seqs 8"),
    (dict(num_blocks=3), "raise memory_budget_bytes"),
    (dict(max_model_len=5000), "context length"),
    (dict(bogus_option=1), "unknown engine options"),
])
def test_impossible_configuration_says_what_to_change(checkpoints, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=checkpoints["llama"], device="cpu", **tiny_engine_options(**options))


def test_a_default_context_is_lowered_to_what_the_kv_cache_holds(checkpoints):
    """No max_model_len given: the checkpoint's 2,048 tokens, lowered to the 8 usable blocks
    of 16 tokens; prompts beyond it are refused naming the served length, shorter ones run."""
    options = tiny_engine_options(num_blocks=9, block_size=16)
    del options["max_model_len"]
    llm = LLM(model=checkpoints["llama"], device="cpu", **options)
    try:
        assert llm.engine.config.max_model_len == 128
        with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
            llm.generate([{"prompt_token_ids": list(range(5, 133))}], SamplingParams(max_tokens=4))
        [out] = llm.generate([{"prompt_token_ids": list(range(5, 105))}],
                             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 20
    finally:
        llm.shutdown()
