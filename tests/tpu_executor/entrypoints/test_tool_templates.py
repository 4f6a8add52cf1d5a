"""Two-turn tool conversations (a call, its result, an answer) through chat templates we wrote
from each family's documented tool format, sent per request (``chat_template``) to servers
reading that format: Llama-3.1 (JSON calls, results in the ``ipython`` role), Mistral v0.3
(``[TOOL_CALLS]``, call ids of exactly 9 letters or digits, enforced as its templates do)
and Qwen3 (Hermes ``<tool_call>`` blocks)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine

LLAMA31 = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}"
    "<|end_header_id|>\n\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": {{ c['function']['arguments'] | tojson }}}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = (
    "{% macro checked(id) %}{% if id is not string or id | length != 9 or not id.isalnum() %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}{% endmacro %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'tool' %}{{ checked(m['tool_call_id']) }}[TOOL_RESULTS] "
    "{\"content\": {{ m['content'] | tojson }}, \"call_id\": \"{{ m['tool_call_id'] }}\"}[/TOOL_RESULTS]"
    "{% elif m.get('tool_calls') %}[TOOL_CALLS] [{% for c in m['tool_calls'] %}{{ checked(c['id']) }}"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}, "
    "\"id\": \"{{ c['id'] }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
HERMES = (
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% elif m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"llama3_json": LLAMA31, "mistral": MISTRAL, "hermes": HERMES}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
QUESTION = {"role": "user", "content": "what time is it"}


def chat(url: str, fmt: str, messages, stream: bool = False, **fields) -> dict:
    """The response's message, finish reason and usage, put together from the deltas when streamed."""
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 40, "temperature": 0,
            "chat_template": TEMPLATES[fmt], "stream": stream, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        whole = response.json()
        return dict(whole["choices"][0], usage=whole["usage"])
    message, calls, finish_reason, usage = {"content": ""}, {}, None, None
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        usage = chunk["usage"] or usage
        for choice in chunk["choices"]:
            message["content"] += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:  # a call's arguments come in pieces
                call = calls.setdefault(delta["index"], {"function": {"arguments": ""}})
                call.update({key: delta[key] for key in ("id", "type") if key in delta})
                call["function"]["name"] = delta["function"].get("name") or call["function"].get("name")
                call["function"]["arguments"] += delta["function"].get("arguments") or ""
            finish_reason = choice["finish_reason"] or finish_reason
    message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return {"message": message, "finish_reason": finish_reason, "usage": usage}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_a_call_its_result_and_an_answer_render_and_run(checkpoints, fmt, stream):
    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu"))
    with live_server(engine, tool_call_parser=fmt, trust_request_chat_template=True) as (url, _):
        first = chat(url, fmt, [QUESTION], stream, tool_choice={"type": "function", "function": {"name": "get_time"}})
        call = first["message"]["tool_calls"][0]
        call = {key: call[key] for key in ("id", "type", "function")}
        assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
        assert fmt != "mistral" or (len(call["id"]) == 9 and call["id"].isalnum())
        # The same turn as a client of another server would send it back: an OpenAI-style id.
        for call_id in (call["id"], "call_8f2a0c1e9b7d4e55"):
            answered = [QUESTION, {"role": "assistant", "content": None,
                                   "tool_calls": [dict(call, id=call_id)]},
                        {"role": "tool", "tool_call_id": call_id, "content": "12:00 UTC"}]
            answer = chat(url, fmt, answered, stream, tool_choice="none", max_tokens=4, ignore_eos=True)
            assert answer["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 4
            # The result went through the template: the prompt grew by it.
            assert answer["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 8
