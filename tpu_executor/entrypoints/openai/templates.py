"""Chat templates rendered as transformers renders them, but off the event loop and within
limits: a render that runs past its time or builds text past its size is stopped and answered
with a 400, and the server goes on serving.

The output is transformers' own: the template is compiled in a copy of the Jinja environment
transformers builds for chat templates (its filters and globals: ``tojson``,
``raise_exception``, ``strftime_now``, ``{% generation %}``, loop controls) and given the
variables ``tokenizer.apply_chat_template`` gives it. What the copy adds are the bounds:

- time: the render runs on a worker thread under a ``sys.settrace`` tracer that raises once the
  deadline has passed, at the next line of template code or the next Python call (Python
  threads cannot be killed, so the render aborts itself and frees its core);
- size: every operation that can turn short input into long text in one step is checked before
  it runs (``template_bounds.py``), and the output as it comes. Jinja's sandbox already caps
  ``range`` at 100,000.

These bound what one template can cost; they are no reason to trust one. A template a client
sends is refused unless the operator passes ``--trust-request-chat-template``.
"""
from __future__ import annotations

import asyncio
import functools
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tpu_executor.entrypoints.openai.template_bounds import (
    FILTER_SIZES,
    Bounds,
    ChatTemplateError,
    TemplateLimitError,
    bounded_filter,
)

RENDER_THREADS = 4  # renders run one at a time under the GIL; more threads keep a slow one from queueing others
_TEMPLATE_FILE = "<template>"  # the file name Jinja compiles template code under


class _Overtime(BaseException):
    """Raised into a render by its tracer once the deadline has passed. Not an ``Exception``,
    so no ``except Exception`` on the way out (in Jinja or in a template's callees) swallows it."""


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, but ``a ~ b`` checks the size of its parts first."""

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"{join}(environment.sized_parts((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write(")))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with every text-building operation bounded
    (``Bounds``): operators, method calls, the ``~`` concatenation and each output."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, bounds: Bounds, **options):
        super().__init__(finalize=self.sized_output, **options)
        self.bounds = bounds

    def call_binop(self, context, operator, left, right):
        self.bounds.binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):  # positional-only: a template may pass any keyword
        return super().call(context, obj, *self.bounds.method(obj, args, kwargs), **kwargs)

    def sized_parts(self, parts: tuple) -> tuple:
        self.bounds.check(sum(self.bounds.size(p) for p in parts), "a concatenation (~)")
        return parts

    def sized_output(self, value: Any) -> Any:
        if not isinstance(value, str):  # a string is written as is; anything else through str()
            self.bounds.check(self.bounds.size(value), "an output")
        return value


def bounded_environment(max_chars: int) -> jinja2.Environment:
    """A copy of the environment transformers compiles chat templates in (its options,
    extensions, filters and globals), bounded to text of ``max_chars`` characters."""
    from transformers.utils import chat_template_utils

    # transformers builds its environment along with each compiled template; an empty one shows it.
    reference = chat_template_utils._compile_jinja_template("").environment
    bounds = Bounds(max_chars)
    environment = _BoundedEnvironment(
        bounds, trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
        keep_trailing_newline=reference.keep_trailing_newline, autoescape=reference.autoescape,
        extensions=[type(extension) for extension in reference.extensions.values()])
    environment.globals.update(reference.globals)
    environment.filters.update(reference.filters)
    for name in FILTER_SIZES:
        environment.filters[name] = bounded_filter(name, reference.filters[name], bounds)
    return environment


def _deadline_tracer(deadline: float):
    """A ``sys.settrace`` function that raises ``_Overtime`` past ``deadline``: at any Python
    call in the thread (a filter's or Jinja's runtime's) and at each line of template code (a
    loop in the template itself may call nothing)."""
    def on_line(frame, event, arg):
        if event == "line" and time.monotonic() > deadline:
            raise _Overtime
        return on_line

    def on_call(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Overtime
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    return on_call


# transformers' names for a message's reasoning; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where a continued message ends


def _template_messages(conversation: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages as ``apply_chat_template`` gives them to a template: keys whose value is
    None dropped, the reasoning under each of its names (``thinking`` for gpt-oss's templates)."""
    messages = []
    for message in conversation:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


class ChatTemplates:
    """Renders chat templates for one tokenizer, as ``tokenizer.apply_chat_template(...,
    tokenize=False)`` does, on worker threads, each render stopped after ``timeout_s`` seconds
    or once it builds text longer than ``max_chars`` (``TemplateLimitError``)."""

    def __init__(self, tokenizer, timeout_s: float, max_chars: int):
        self.tokenizer, self.timeout_s, self.max_chars = tokenizer, timeout_s, max_chars
        self.environment = bounded_environment(max_chars)
        self._compiled = functools.lru_cache(maxsize=16)(self.environment.from_string)
        self._threads = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="chat-template")

    def source(self, template: Optional[str], tools: Optional[list]) -> str:
        """The template to render: ``template`` (or the model's template of that name), else the
        model's own; ``ValueError`` when there is none."""
        return self.tokenizer.get_chat_template(template, tools)

    async def render(self, source: str, conversation: List[Dict[str, Any]], **options) -> str:
        """``source`` rendered over ``conversation`` (see ``render_now`` for ``options``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(self.render_now, source, conversation,
                                                                           **options))

    def render_now(self, source: str, conversation: List[Dict[str, Any]], tools: Optional[list] = None,
                   documents: Optional[list] = None, add_generation_prompt: bool = False,
                   continue_final_message: bool = False, template_kwargs: Optional[Dict[str, Any]] = None) -> str:
        """The rendered text, on this thread, within the limits. ``template_kwargs`` are the
        template's further variables (beside the tokenizer's special tokens)."""
        previous = sys.gettrace()  # a debugger's or coverage's, put back afterwards
        sys.settrace(_deadline_tracer(time.monotonic() + self.timeout_s))
        try:
            variables = {**self.tokenizer.special_tokens_map, **(template_kwargs or {}), "tools": tools,
                         "documents": documents, "add_generation_prompt": add_generation_prompt}
            return self._render(source, _template_messages(conversation), variables, continue_final_message)
        except _Overtime:
            raise TemplateLimitError(f"the chat template ran past this server's time limit of {self.timeout_s:g} s "
                                     "per render") from None
        finally:
            sys.settrace(previous)

    def _render(self, source: str, messages: List[Dict[str, Any]], variables: Dict[str, Any],
                continue_final_message: bool) -> str:
        try:
            template = self._compiled(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err}") from None
        if not continue_final_message:
            return self._generate(template, messages, variables)
        # As transformers continues the last message: mark its end, render, cut at the mark.
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ValueError('continue_final_message is set but the final message has no "content" to continue')
        if "content" not in source:
            raise ValueError('continue_final_message is set but the chat template does not read "content"')
        messages = messages[:-1] + [dict(messages[-1], content=final + _CONTINUE_TAG)]
        text = self._generate(template, messages, variables)
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message is set but the chat template drops part of the final message")
        end = text.rindex(_CONTINUE_TAG.strip())
        return text[:end] if text[end:end + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:end].rstrip()

    def _generate(self, template: jinja2.Template, messages: List[Dict[str, Any]], variables: Dict[str, Any]) -> str:
        """The template's output, piece by piece, stopped once it passes the size limit."""
        pieces, size = [], 0
        for piece in template.generate(variables, messages=messages):
            size += len(piece)
            self.environment.bounds.check(size, "a text")
            pieces.append(piece)
        return "".join(pieces)
