"""Chat templates: rendered exactly as transformers renders them, off the event loop and within
a time and size limit (a template past either gets a 400 naming it, fast, while /health keeps
answering); a template sent with a request is refused unless the server trusts them."""
from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.common import live_server, tiny_engine_options
from tests.tpu_executor.entrypoints.test_tool_templates import TEMPLATES as TOOL_TEMPLATES
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.entrypoints.openai.templates import ChatTemplates, TemplateLimitError

# transformers' extras and Jinja's features a real template uses: namespaces, loop controls,
# macros, generation tags, raise_exception, strftime_now, tojson with indent, the special tokens.
FEATURES = (
    "{%- macro turn(m) -%}<|{{ m.role }}|>{{ m.content | trim }}{% if m.thinking is defined %}"
    "[{{ m.thinking }}]{% endif %}{%- endmacro -%}"
    "{{ bos_token }}{% set ns = namespace(users=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if m.role == 'wizard' %}{{ raise_exception('no wizards') }}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ turn(m) }}{% endgeneration %}{% else %}{{ turn(m) }}{% endif %}"
    "{% if loop.index > 6 %}{% break %}{% endif %}\n{% endfor %}"
    "{{ ns.users }} users, year {{ strftime_now('%Y') }}, {{ dict(a=1) | tojson(indent=2) }}"
    "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for d in documents or [] %}<doc>{{ d.text | wordwrap(20) | indent(2) }}</doc>{% endfor %}"
    "{{ '%s-%d' | format('x', 3) }}{{ ['a', 'b'] | join('|') | center(9) | replace(' ', '.') }}"
    "{% if shout %}LOUD{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " ka lo "},
                {"role": "assistant", "content": "mi", "reasoning_content": "hmm"},
                {"role": "user", "content": "ne ru ta shi po ve zu an el ka lo mi ne ru ta"}]
TEMPLATE_CASES = {
    "features": (FEATURES, dict(tools=[TOOL], documents=[{"title": "t", "text": "word " * 12}], shout=True)),
    "features, continued": (FEATURES, dict(add_generation_prompt=False, continue_final_message=True)),
    **{f"{fmt} tool template": (template, dict(tools=[TOOL])) for fmt, template in TOOL_TEMPLATES.items()},
}


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return AutoTokenizer.from_pretrained(checkpoints["llama"])


@pytest.mark.parametrize("template, options", TEMPLATE_CASES.values(), ids=list(TEMPLATE_CASES))
def test_a_render_is_exactly_transformers_render(tokenizer, template, options):
    options = dict({"add_generation_prompt": True}, **options)
    expected = tokenizer.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False, **options)
    core = {name: options.pop(name) for name in ("tools", "documents", "add_generation_prompt",
                                                  "continue_final_message") if name in options}
    rendered = ChatTemplates(tokenizer, 2.0, 1 << 20).render_now(template, CONVERSATION, template_kwargs=options,
                                                                  **core)
    assert rendered == expected


def test_a_template_error_is_the_templates_own(tokenizer):
    with pytest.raises(Exception, match="no wizards"):
        ChatTemplates(tokenizer, 2.0, 1 << 20).render_now(FEATURES, [{"role": "wizard", "content": "x"}])


# Templates that would run for hours or allocate gigabytes in one step.
RUNAWAY = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repeated string": "{{ 'a' * 10**10 }}",
    "power": "{{ 7 ** 1000000000 }}",
    "doubling concatenation": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                              "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "nested list written out": "{% set s = 'a' * 100000 %}{% set ns = namespace(l=[s, s]) %}"
                               "{% for i in range(30) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
    "padding method": "{{ 'a'.rjust(10**10) }}",
    "padding filter": "{{ 'a' | center(10**10) }}",
    "format width": "{{ '%10000000000s' | format('a') }}",
    "joined copies": "{% set s = 'a' * 100000 %}{{ ([s] * 1000) | join }}",
    "replace": "{{ ('a' * 100000) | replace('a', 'a' * 1000) }}",
    "lorem ipsum": "{{ lipsum(10**7) }}",
    "long output": "{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("template", RUNAWAY.values(), ids=list(RUNAWAY))
def test_a_runaway_template_is_stopped_at_its_limit(tokenizer, template):
    start = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="time limit of 0.5 s|longer than this server's limit|bits"):
        ChatTemplates(tokenizer, 0.5, 1 << 20).render_now(template, CONVERSATION)
    assert time.perf_counter() - start < 1.5
    assert sys.gettrace() is None  # the thread's tracing is put back


@pytest.fixture(scope="module")
def servers(checkpoints):
    """(trusting server's URL, default server's URL): a second server trusts request templates,
    with a render time limit of 1 s."""
    options = tiny_engine_options(device="cpu")
    with live_server(LLMEngine.from_options(checkpoints["llama"], **options)) as (default, _):
        with live_server(LLMEngine.from_options(checkpoints["llama"], **options), trust_request_chat_template=True,
                         chat_template_timeout_s=1.0) as (trusting, _):
            yield trusting, default


def template_ids(tokenizer, template=None):
    text = tokenizer.apply_chat_template(CONVERSATION, chat_template=template, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": CONVERSATION[1:2], "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("fields, param", [({"chat_template": "{{ 1 }}"}, "chat_template"),
                                           ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                                            "chat_template_kwargs")])
def test_a_request_template_is_refused_unless_the_server_trusts_them(servers, tokenizer, fields, param):
    trusting, default = servers
    for response in (chat(default, **fields),
                     httpx.post(default + "/tokenize", json={"messages": CONVERSATION[1:2], **fields})):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "--trust-request-chat-template" in error["message"], error
    assert chat(trusting, **fields).json()["usage"]["prompt_tokens"] == 1  # "1" is one token
    # The model's own template serves as before, on both.
    expected = template_ids(tokenizer)
    for url in servers:
        assert httpx.post(url + "/tokenize", json={"messages": CONVERSATION}).json()["tokens"] == expected
        assert chat(url, messages=CONVERSATION).json()["usage"]["prompt_tokens"] == len(expected)


def test_a_trusted_request_template_renders_what_transformers_renders(servers, tokenizer):
    template = TOOL_TEMPLATES["hermes"]
    expected = template_ids(tokenizer, template)
    response = httpx.post(servers[0] + "/tokenize", json={"messages": CONVERSATION, "chat_template": template})
    assert response.json()["tokens"] == expected
    assert chat(servers[0], messages=CONVERSATION, chat_template=template).json()["usage"]["prompt_tokens"] == \
        len(expected)
    broken = chat(servers[0], chat_template="{% for %}")
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template", broken.text
    assert "does not compile" in broken.json()["error"]["message"]


def test_runaway_templates_get_a_400_fast_and_the_server_keeps_serving(servers):
    url = servers[0]
    answers = {}

    def send(name):
        start = time.perf_counter()
        answers[name] = (chat(url, chat_template=RUNAWAY[name]), time.perf_counter() - start)

    senders = [threading.Thread(target=send, args=(name,)) for name in ("nested loops", "repeated string")]
    for sender in senders:
        sender.start()
    health = []
    while any(sender.is_alive() for sender in senders):
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        health.append(time.perf_counter() - start)
    for name, words in (("nested loops", "time limit of 1 s"), ("repeated string", "longer than")):
        response, seconds = answers[name]
        assert response.status_code == 400 and seconds < 2.5, (name, seconds, response.text)
        assert response.json()["error"]["param"] == "chat_template" and words in response.json()["error"]["message"]
    assert health and max(health) < 0.5, health
    assert chat(url).status_code == 200
