"""Checks of a request against the model and the engine's limits, before anything is queued:
each failure is a ValueError whose message starts with the field at fault (the server turns
it into a 400 naming that field). They read only fixed facts (config, tokenizer, vocabulary),
so any thread may run them while the engine steps."""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams
from tpu_executor.engine.structured_outputs import GrammarCompiler


class RequestChecks:
    """Prompt and sampling-parameter checks of one engine."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int):
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self._grammar_compiler: Optional[GrammarCompiler] = None
        self._lock = threading.Lock()
        self._on_grammar_compiled: Optional[Callable[[float], None]] = None  # a metric's observer
        self._adapters: Dict[int, LoRARequest] = {}  # lora_int_id -> the adapter checked under it
        self._model_config: Optional[Dict] = None  # the checkpoint's config, for adapters' shapes

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, made on first use (reading a large vocabulary takes
        a moment, and most engines never see a grammar)."""
        with self._lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size,
                                                                       self._on_grammar_compiled,
                                                                       self.config.model.reasoning_parser)
            return self._grammar_compiler

    def observe_grammar_compiles(self, observer: Callable[[float], None]) -> None:
        """Call ``observer(seconds)`` after each grammar compilation from now on."""
        with self._lock:
            self._on_grammar_compiled = observer
            if self._grammar_compiler is not None:
                self._grammar_compiler.on_compiled = observer

    def prompt_token_ids(self, prompt) -> List[int]:
        """A prompt (text, or ``{'prompt_token_ids': [...]}``) as token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def validate(self, token_ids: List[int], params: SamplingParams) -> None:
        """Raise ValueError if ``token_ids`` cannot run on this engine with ``params``."""
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or (vocab and t >= vocab)]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.config.max_model_len} tokens, "
                             f"but the prompt has {len(token_ids)} tokens (it must leave room for output; "
                             "max_model_len sets the limit)")
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > self.config.compile.max_logprobs:
                raise ValueError(f"{name} {wanted} exceeds max_logprobs {self.config.compile.max_logprobs} "
                                 "of this engine")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if vocab and t >= vocab]
            if outside:
                raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab}): {outside[:8]}")
        self.bad_words_token_ids(params)
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)  # compiled once, then cached

    def lora(self, lora_request: Optional[LoRARequest]) -> None:
        """Raise ValueError (``lora_request``'s fault) if the request's adapter cannot run here:
        the engine serves none, its id names another adapter, or the adapter does not fit the
        model (checked once per adapter, from its config and its weights)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        lora = self.config.lora
        if not lora.enable_lora:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it with enable_lora=True)")
        with self._lock:
            known = self._adapters.get(lora_request.lora_int_id)
        if known is not None and known.lora_path != lora_request.lora_path:
            raise ValueError(f"lora_request: lora_int_id {lora_request.lora_int_id} is adapter {known.lora_path!r}, "
                             f"not {lora_request.lora_path!r}")
        if known is None:
            from tpu_executor.worker.lora_loader import check_adapter
            from tpu_executor.worker.model_loader import load_hf_config

            with self._lock:  # the model's config is read once, for the first adapter
                if self._model_config is None:
                    self._model_config = load_hf_config(self.config.model.model).to_dict()
            check_adapter(lora_request.lora_path, self._model_config, lora.max_lora_rank)
            with self._lock:
                self._adapters[lora_request.lora_int_id] = lora_request

    def forget_lora(self, lora_int_id: int) -> None:
        """Forget adapter ``lora_int_id`` (unloaded): its id may name another adapter next."""
        with self._lock:
            self._adapters.pop(lora_int_id, None)

    def bad_words_token_ids(self, params: SamplingParams) -> Tuple[Tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences, each word as it starts the text and after a
        space (as vLLM does); ValueError for words the device cannot hold."""
        words = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words += [tuple(plain)] + ([tuple(spaced)] if len(spaced) == len(plain) and spaced != plain else [])
        longest = max(words, key=len, default=())
        if len(longest) > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words: {self.tokenizer.decode(longest)!r} is {len(longest)} tokens long; "
                             f"at most {MAX_BAD_WORD_TOKENS} are allowed")
        if sum(len(w) > 1 for w in words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {sum(len(w) > 1 for w in words)} words of several tokens (counting "
                             f"each with and without a leading space); at most {MAX_BAD_WORDS} are allowed")
        return tuple(words)
