"""Incremental detokenization equals a full decode; stop strings, EOS, stop ids, max_tokens."""
import pytest
from transformers import AutoTokenizer

from tpu_executor.core.detokenizer import Detokenizer
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def feed(detok, tokenizer, prompt, output_ids, params):
    request = Request("r", list(prompt), params, seed=0, eos_token_id=tokenizer.eos_token_id)
    state = detok.new_state(prompt)
    status = None
    for token in output_ids:
        request.output_token_ids.append(token)
        status = detok.advance(request, state)
        if status is not None:
            break
    return request, state, status


@pytest.mark.parametrize("text", ["Hello world, ça va? 東京は晴れ 🙂 done", "  spaced   out\n\nlines"])
def test_incremental_text_equals_full_decode(tokenizer, text):
    detok = Detokenizer(tokenizer, max_model_len=1000)
    prompt = tokenizer("Say:")["input_ids"]
    output = tokenizer(text)["input_ids"]
    _, state, _ = feed(detok, tokenizer, prompt, output, SamplingParams(max_tokens=500))
    assert state.text == tokenizer.decode(output, skip_special_tokens=True)


def test_stop_string_truncates_and_stops(tokenizer):
    detok = Detokenizer(tokenizer, max_model_len=1000)
    output = tokenizer("one two three STOP four five")["input_ids"]
    request, state, status = feed(detok, tokenizer, [1], output, SamplingParams(stop=["STOP"], max_tokens=100))
    assert status is RequestStatus.FINISHED_STOPPED and request.stop_reason == "STOP"
    assert state.text == "one two three "
    _, state, _ = feed(detok, tokenizer, [1], output, SamplingParams(stop="STOP", include_stop_str_in_output=True))
    assert state.text == "one two three STOP"


def test_eos_stop_ids_and_length(tokenizer):
    detok = Detokenizer(tokenizer, max_model_len=1000)
    ids = tokenizer("a b c d e f")["input_ids"]
    _, _, status = feed(detok, tokenizer, [1], ids[:2] + [tokenizer.eos_token_id], SamplingParams(max_tokens=50))
    assert status is RequestStatus.FINISHED_STOPPED
    request, _, status = feed(detok, tokenizer, [1], ids[:2] + [tokenizer.eos_token_id] + ids,
                              SamplingParams(max_tokens=50, ignore_eos=True))
    assert status is None and len(request.output_token_ids) == 3 + len(ids)
    request, _, status = feed(detok, tokenizer, [1], ids, SamplingParams(stop_token_ids=[ids[1]]))
    assert status is RequestStatus.FINISHED_STOPPED and request.stop_reason == ids[1]
    request, _, status = feed(detok, tokenizer, [1], ids, SamplingParams(max_tokens=3))
    assert status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 3


def test_stream_and_window_paths_give_the_same_text(tokenizer):
    """The DecodeStream path (fast tokenizers) against the two-decode window path."""
    fast = Detokenizer(tokenizer, max_model_len=10_000)
    assert fast._backend is not None
    window = Detokenizer(tokenizer, max_model_len=10_000)
    window._backend = None
    prompt = tokenizer("Once upon a time")["input_ids"]
    output = tokenizer("there was a café in Zürich, 東京 too 🙂, and\n  a   space")["input_ids"] + [tokenizer.eos_token_id] + \
        tokenizer(" after the end")["input_ids"]
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    _, fast_state, _ = feed(fast, tokenizer, prompt, output, params)
    _, window_state, _ = feed(window, tokenizer, prompt, output, params)
    assert fast_state.stream is not None and window_state.stream is None
    assert fast_state.text == window_state.text == tokenizer.decode(output, skip_special_tokens=True)
