"""vLLM's request fields beyond OpenAI's, honoured over HTTP on a tiny Llama: what the chat
template gets (``chat_template_kwargs``, a per-request ``chat_template``,
``continue_final_message``), ``add_special_tokens`` and ``truncate_prompt_tokens``; each
checked against a completion of the prompt the field should have made."""
from __future__ import annotations

import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from tests.common import live_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine

# A template that writes a word only when its keyword argument says so.
SHOUTING_TEMPLATE = "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def with_bos(checkpoint: str, root) -> str:
    """A copy of ``checkpoint`` whose tokenizer puts BOS before every text it encodes with
    special tokens (as Llama's and Gemma's do; the random one adds none)."""
    from tokenizers.processors import TemplateProcessing

    copy = str(root / "with_bos")
    shutil.copytree(checkpoint, copy)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                                    special_tokens=[("<s>", bos)])
    tokenizer.save_pretrained(copy)
    return copy


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    checkpoint = with_bos(checkpoints["llama"], tmp_path_factory.mktemp("fields"))
    engine = LLMEngine.from_options(checkpoint, **tiny_engine_options(device="cpu"))
    with live_server(engine) as (url, _):
        yield url, AutoTokenizer.from_pretrained(checkpoint)


def chat(url: str, **body) -> dict:
    response = httpx.post(url + "/v1/chat/completions", json=dict(GREEDY, **body), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def completion(url: str, prompt, **body) -> dict:
    response = httpx.post(url + "/v1/completions", json=dict(GREEDY, prompt=prompt, **body), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_template_kwargs_and_a_request_template_reach_the_template(served):
    url, tokenizer = served
    messages = [{"role": "user", "content": "ka lo mi"}]
    for shout in (True, False):
        out = chat(url, messages=messages, chat_template=SHOUTING_TEMPLATE, chat_template_kwargs={"shout": shout})
        text = ("LOUD " if shout else "") + "ka lo mi "
        same = completion(url, text, add_special_tokens=False)
        assert out["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert out["choices"][0]["message"]["content"] == same["choices"][0]["text"]


def test_continue_final_message_continues_the_assistant_turn(served):
    url, tokenizer = served
    messages = [{"role": "user", "content": "ka lo"}, {"role": "assistant", "content": "mi ra"}]
    out = chat(url, messages=messages, add_generation_prompt=False, continue_final_message=True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.rstrip().endswith("mi ra")
    assert out["choices"][0]["message"]["content"] == completion(url, text, add_special_tokens=False)[
        "choices"][0]["text"]


def test_add_special_tokens_and_truncate_prompt_tokens(served):
    url, tokenizer = served
    plain = len(tokenizer("ka lo mi", add_special_tokens=False)["input_ids"])
    assert completion(url, "ka lo mi")["usage"]["prompt_tokens"] == plain + 1  # the BOS
    assert completion(url, "ka lo mi", add_special_tokens=False)["usage"]["prompt_tokens"] == plain
    messages = [{"role": "user", "content": "ka lo mi"}]
    chat_default, chat_bos = (chat(url, messages=messages, add_special_tokens=flag)["usage"]["prompt_tokens"]
                              for flag in (False, True))
    assert chat_bos == chat_default + 1  # chat adds none unless asked (a template writes its own)
    ids = list(range(10, 60))
    cut = completion(url, ids, truncate_prompt_tokens=12, echo=True)
    assert cut["usage"]["prompt_tokens"] == 12
    tail = completion(url, ids[-12:], echo=True)
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("skip_special_tokens", False),
                                         ("priority", 3), ("cache_salt", "s"), ("echo", True)])
def test_a_vllm_field_this_server_does_not_implement_is_a_400_naming_it(served, field, value):
    response = httpx.post(served[0] + "/v1/chat/completions",
                          json=dict(GREEDY, messages=[{"role": "user", "content": "hi"}], **{field: value}))
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
