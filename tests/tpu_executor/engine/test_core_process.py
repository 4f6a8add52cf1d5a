"""The engine core in a process of its own (``core_process=True``): the same outputs as the
in-process engine, token for token; aborts, reused ids, figures, a failed start-up, a lost
core process, and a live server read by the ``openai`` client."""
import httpx
import openai
import pytest
import torch

from tests.common import (
    assert_nothing_compiled_after_warmup,
    assert_same_outputs_over_random_requests,
    live_server,
    preempting_llm_pair,
    run_to_end,
    tiny_engine_options,
)
from tpu_executor import LLM, EngineDeadError, SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # each engine spawns its core (imports, model load: ~10 s)

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(in-process, core process) native engines that preempt and chunk prompts."""
    with preempting_llm_pair(checkpoints["llama"], "core_process") as pair:
        yield pair


def test_outputs_equal_the_in_process_engines_over_200_random_requests(engines):
    local, remote = engines
    assert_same_outputs_over_random_requests(local, remote)
    stats = remote.stats()
    assert stats.num_preemptions > 0
    assert_nothing_compiled_after_warmup(remote)
    assert set(stats.startup_seconds) >= {"load_model", "warmup"}


def test_an_abort_ends_one_request_and_its_id_is_free_once_the_core_let_it_go(engines):
    local, remote = engines
    [expected] = local.generate({"prompt_token_ids": [7, 8, 9]}, GREEDY, use_tqdm=False)
    engine = remote.engine
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id="doomed")
    engine.add_request({"prompt_token_ids": [7, 8, 9]}, GREEDY, request_id="kept")
    deltas = engine.step() + engine.step()
    engine.abort_request("doomed")
    with pytest.raises(ValueError, match="already in use"):  # its last delta is not out yet
        engine.add_request({"prompt_token_ids": [5]}, GREEDY, request_id="doomed")
    deltas += run_to_end(engine)
    totals = accumulate_deltas(deltas)
    assert totals["doomed"].outputs[0].finish_reason == "abort"
    assert totals["kept"].outputs[0].token_ids == expected.outputs[0].token_ids
    engine.add_request({"prompt_token_ids": [7, 8, 9]}, GREEDY, request_id="doomed")
    again = accumulate_deltas(run_to_end(engine))["doomed"]
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    assert remote.stats().kv_blocks_used == 0


def test_a_core_that_cannot_start_names_the_cause(checkpoints):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(RuntimeError, match="the engine core failed to start: .*"):
        LLM(model=checkpoints["llama"], core_process=True, **tiny_engine_options(device="cuda"))


def test_a_lost_core_process_fails_every_request_and_the_engine(checkpoints):
    llm = LLM(model=checkpoints["llama"], core_process=True, **tiny_engine_options(device="cpu"))
    engine = llm.engine
    try:
        ids = [engine.add_request({"prompt_token_ids": [5, 6, i]}, SamplingParams(max_tokens=200, ignore_eos=True))
               for i in range(3)]
        engine.step()
        engine.core._process.kill()
        with pytest.raises(EngineDeadError, match="engine core process exited") as failure:
            run_to_end(engine)
        assert sorted(o.request_id for o in failure.value.outputs) == sorted(ids)
        assert all(o.finished and o.outputs[0].finish_reason == "error" for o in failure.value.outputs)
        assert not engine.has_unfinished_requests()
        with pytest.raises(EngineDeadError, match="shut down"):
            engine.add_request({"prompt_token_ids": [5]}, SamplingParams())
    finally:
        llm.shutdown()


def test_a_server_over_a_core_process_streams_the_in_process_engines_text(engines, checkpoints):
    local, _ = engines
    prompts = ["the quick brown fox", "lorem ipsum dolor"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in local.generate(prompts, params, use_tqdm=False)]
    engine = LLMEngine.from_options(checkpoints["llama"], core_process=True, **tiny_engine_options(device="cpu"))
    with live_server(engine) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, text in zip(prompts, expected):
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in chunks) == text
        metrics = httpx.get(url + "/metrics", timeout=30)  # the core's figures, asked over the pipe
        assert metrics.status_code == 200 and "tpu_executor:compilations_after_warmup 0.0" in metrics.text
