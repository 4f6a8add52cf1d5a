"""Tool calling in chat: the request's ``tools`` and ``tool_choice`` checked, the grammar that
``required`` and a named tool impose, and each choice's output read back as OpenAI
``tool_calls``, whole or streamed.

``tool_choice``: ``none`` (tools shown to the model, output left as text), ``auto`` (the
output parsed by the family's format, ``tool_parsers.py``), ``required`` (a grammar makes the
output a JSON list of one or more ``{"name", "parameters"}`` calls of the given tools, as vLLM
does), or a named function (a grammar makes the output that function's arguments); the JSON of
both is compact (machines read it; blanks would only cost tokens).
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

from tpu_executor.core.sampling_params import StructuredOutputsParams
from tpu_executor.engine.structured_outputs import checked_schema
from tpu_executor.entrypoints.openai import tool_parsers
from tpu_executor.entrypoints.openai.protocol import bad_request
from tpu_executor.entrypoints.openai.tool_parsers import ParsedCall

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}


def checked_tools(tools: Optional[List[Dict[str, Any]]]) -> Dict[str, dict]:
    """Each tool's parameters schema by function name; 400 naming ``tools`` when malformed."""
    schemas: Dict[str, dict] = {}
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{index}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                              "tools")
        if name in schemas:
            raise bad_request(f"tools[{index}].function.name {name!r} is given twice", "tools")
        parameters = function.get("parameters", _NO_PARAMETERS)
        try:
            schemas[name] = checked_schema(json.dumps(parameters))
        except (TypeError, ValueError) as err:
            message = str(err).replace("structured_outputs.json", f"tools[{index}].function.parameters")
            raise bad_request(message, "tools") from None
    return schemas


def _named_function(tool_choice: Any) -> str:
    """The function name of a ``tool_choice`` object, ``{"type": "function", "function":
    {"name": ...}}``; a 400 naming ``tool_choice`` for any other shape."""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise bad_request("tool_choice must be none, auto, required or {'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {json.dumps(tool_choice)[:200]}", "tool_choice")
    return name


class ToolChoice:
    """A chat request's tools and what it asks of them (checked once)."""

    def __init__(self, tools: Optional[List[Dict[str, Any]]], tool_choice, parallel_tool_calls: bool, fmt: str):
        self.schemas = checked_tools(tools)
        self.tools = tools or None
        self.parallel = parallel_tool_calls
        self.format = fmt
        self.mode, self.named = self._mode(tool_choice)

    def _mode(self, tool_choice) -> Tuple[str, Optional[str]]:
        if tool_choice is None:
            return ("auto" if self.schemas else "none"), None
        if isinstance(tool_choice, str):
            if tool_choice not in ("none", "auto", "required"):
                raise bad_request(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
                                  "tool_choice")
            if tool_choice != "none" and not self.schemas:
                raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
            return tool_choice, None
        name = _named_function(tool_choice)
        if name not in self.schemas:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        return "named", name

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def grammar(self) -> Optional[StructuredOutputsParams]:
        """The grammar ``required`` or a named function imposes (None otherwise)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.schemas[self.named], disable_any_whitespace=True)
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.schemas.items()]
        listed = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputsParams(json=listed if self.parallel else {**listed, "maxItems": 1},
                                       disable_any_whitespace=True)

    def parse(self, text: str) -> Tuple[Optional[str], List[ParsedCall]]:
        """(content, calls) of a whole output."""
        if self.mode == "named":
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":
            values = tool_parsers.json_values(text)
            calls = [tool_parsers.call_of(o) for o in values[0]] if values and isinstance(values[0], list) else []
            return (None, calls) if calls and all(calls) else (text, [])
        if self.mode != "auto":
            return text, []
        content, calls = tool_parsers.parse(text, self.format)
        return content, calls if self.parallel else calls[:1]  # parallel_tool_calls=false: the first call

    def held_from(self, text: str) -> Optional[int]:
        """Where a stream must start holding ``text`` back (``tool_parsers.held_from``)."""
        if self.mode in ("named", "required"):
            return 0
        return tool_parsers.held_from(text, self.format) if self.mode == "auto" else None


# Mistral's chat templates (Mistral, Mixtral, Nemo) refuse any call id but 9 letters or digits.
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def new_call_id(fmt: str) -> str:
    """A fresh call id: 9 alphanumeric characters in the Mistral format, else OpenAI's form."""
    return uuid.uuid4().hex[:9] if fmt == "mistral" else f"chatcmpl-tool-{uuid.uuid4().hex}"


def template_call_id(call_id: Optional[str], fmt: str) -> Optional[str]:
    """A call id as the template gets it: in the Mistral format one that breaks its rule is
    mapped to 9 hex digits of its hash, the same for the call and the tool message answering it."""
    if fmt != "mistral" or call_id is None or _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def tool_call_json(call: ParsedCall, fmt: str, index: Optional[int] = None) -> Dict[str, Any]:
    """One call in OpenAI's shape (with ``index`` in a streamed delta)."""
    entry = {"id": new_call_id(fmt), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


def conversation_message(message, index: int, fmt: str) -> Dict[str, Any]:
    """One chat message as a chat template reads it: a tool message keeps its call id, an
    assistant's tool calls their arguments as objects (templates write them out as JSON); call
    ids as the format's templates take them."""
    entry: Dict[str, Any] = {"role": message.role, "content": message.text(index)}
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(f"messages[{index}] is a tool message without tool_call_id", f"messages[{index}]")
        entry["tool_call_id"] = template_call_id(message.tool_call_id, fmt)
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [_template_call(call, index, fmt) for call in message.tool_calls]
    reasoning = (message.model_extra or {}).get("reasoning_content") or (message.model_extra or {}).get("reasoning")
    if message.role == "assistant" and isinstance(reasoning, str):  # an earlier turn's, for templates that keep it
        entry["reasoning_content"] = reasoning
    return entry


def _template_call(call: Dict[str, Any], index: int, fmt: str) -> Dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{index}].tool_calls entries need function.name", f"messages[{index}]")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise bad_request(f"messages[{index}].tool_calls arguments are not JSON", f"messages[{index}]") from None
    if not isinstance(call.get("id"), (str, type(None))):
        raise bad_request(f"messages[{index}].tool_calls ids must be strings", f"messages[{index}]")
    return {"id": template_call_id(call.get("id"), fmt), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
