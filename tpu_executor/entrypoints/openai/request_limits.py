"""What one request body may hold, checked before anything reads it: how deep and how finite
its values are, how many tools and messages, and which of vLLM's fields this server refuses."""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Tuple

# Any value in a body, however deep (tool schemas, grammars, unknown fields): a JSON nesting
# this deep or a non-finite number is refused before anything reads it.
MAX_JSON_DEPTH = 64
MAX_TOOLS = 128  # OpenAI's limit
MAX_MESSAGES = 2048

# vLLM's request fields this server does not implement: a value other than these (or null) is a
# 400 naming the field. (The accepted values are the defaults, which change nothing.)
NOT_IMPLEMENTED: Dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "priority": (0,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "return_tokens_as_token_ids": (False,),
    "guided_decoding_backend": ("xgrammar", "auto"), "logits_processors": ((), []), "cache_salt": (),
    "kv_transfer_params": (), "vllm_xargs": ({},), "mm_processor_kwargs": ({},), "structural_tag": (),
    "guided_whitespace_pattern": (), "reasoning_effort": (),
    "logprob_token_ids": ((), []), "thinking_token_budget": (), "repetition_detection": (), "watermarking": (False,),
    "stream_interval": (1,), "return_prompt_text": (False,), "return_token_offsets": (False,),
    "ec_transfer_params": (), "media_io_kwargs": ({},), "mm_payload": ("tensors", "none"),
    "return_mm_kwargs": (True, False), "routed_experts_prompt_start": (0,), "prompt_embeds": (),
}


def json_value_problem(body: Any) -> Optional[Tuple[str, str]]:
    """(message, top-level field) for a value nested deeper than ``MAX_JSON_DEPTH`` or a number
    JSON does not allow (Python's parser reads ``NaN`` and ``Infinity``) anywhere in ``body``;
    None when there is none. Walked without recursion, so no body can exhaust the stack."""
    if not isinstance(body, dict):
        return None
    stack = [(value, str(name), 1) for name, value in body.items()]
    while stack:
        value, field, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"{field} is nested deeper than {MAX_JSON_DEPTH} levels", field
        if isinstance(value, float) and not math.isfinite(value):
            return f"{field} holds {json.dumps(value)}, which JSON does not allow", field
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, field, depth + 1) for child in children)
    return None
