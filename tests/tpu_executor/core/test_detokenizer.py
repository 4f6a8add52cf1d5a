"""Incremental detokenization equals a full decode; stop strings, EOS, stop ids, max_tokens; the
byte-level piece table equals a DecodeStream token by token."""
import random

import pytest
from transformers import AutoTokenizer

from tpu_executor.core.detokenizer import Detokenizer, take_text_delta
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def unsent_text(state) -> str:
    """All the text a state holds (the tests below take no deltas until they say so)."""
    return "".join(state.unsent)


def feed(detok, tokenizer, prompt, output_ids, params):
    request = Request("r", list(prompt), params, seed=0, eos_token_id=tokenizer.eos_token_id)
    state = detok.new_state(request)
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
    assert unsent_text(state) == tokenizer.decode(output, skip_special_tokens=True)


def test_stop_string_truncates_and_stops(tokenizer):
    detok = Detokenizer(tokenizer, max_model_len=1000)
    output = tokenizer("one two three STOP four five")["input_ids"]
    request, state, status = feed(detok, tokenizer, [1], output, SamplingParams(stop=["STOP"], max_tokens=100))
    assert status is RequestStatus.FINISHED_STOPPED and request.stop_reason == "STOP"
    assert unsent_text(state) == "one two three "
    _, state, _ = feed(detok, tokenizer, [1], output, SamplingParams(stop="STOP", include_stop_str_in_output=True))
    assert unsent_text(state) == "one two three STOP"


@pytest.mark.parametrize("include_stop", [False, True])
def test_deltas_add_up_to_the_text_cut_at_its_stop_string(tokenizer, include_stop):
    """Random texts, each with a stop string cut from it (or one it lacks) and an absent longer
    one: deltas taken at random moments, then a last one, add up to the text cut where the
    stop string first occurs (after it, with include_stop_str_in_output), or the whole text.
    A delta is never taken back, so this also shows the hold-back kept every cut unsent."""
    detok = Detokenizer(tokenizer, max_model_len=100_000)
    words = ["alpha", " beta", "gamma ", "STOP", "東京", "🙂", "\n", "x", "ST", "OP", "é"]
    rng = random.Random(1)
    for _ in range(80):
        ids = tokenizer("".join(rng.choice(words) for _ in range(rng.randrange(3, 25))))["input_ids"]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randrange(1, 6)] if rng.random() < 0.8 else "absent"
        stops = [stop, "QQQQQQQQ"] if rng.random() < 0.5 else ["QQQQQQQQ", stop]
        params = SamplingParams(max_tokens=len(ids), stop=stops, include_stop_str_in_output=include_stop)
        request = Request("r", [1], params, seed=0, eos_token_id=tokenizer.eos_token_id)
        state, handed_out, status = detok.new_state(request), "", None
        for token in ids:
            request.output_token_ids.append(token)
            status = detok.advance(request, state)
            if status is not None:
                break
            if rng.random() < 0.6:
                handed_out += take_text_delta(state, finished=False)
        handed_out += take_text_delta(state, finished=True)
        at = full.find(stop)
        expected = full if at == -1 else full[:at + (len(stop) if include_stop else 0)]
        assert handed_out == expected, (full, stops)
        assert (request.stop_reason == stop) == (at != -1)


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
    eos = tokenizer.eos_token_id  # ignored as EOS, asked for as a stop id: it stops, and says so
    request, _, status = feed(detok, tokenizer, [1], ids[:2] + [eos],
                              SamplingParams(ignore_eos=True, stop_token_ids=[eos]))
    assert status is RequestStatus.FINISHED_STOPPED and request.stop_reason == eos
    short = Detokenizer(tokenizer, max_model_len=6)  # the context ends before max_tokens
    request, _, status = feed(short, tokenizer, [1, 2], ids, SamplingParams(max_tokens=50))
    assert status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 4


def test_table_stream_and_window_paths_give_the_same_text(tokenizer):
    """The piece table (byte-level BPE), a DecodeStream per sample primed with the prompt (any
    fast tokenizer) and the two-decode window (any tokenizer) agree on a prompt of text."""
    table = Detokenizer(tokenizer, max_model_len=10_000)
    stream = Detokenizer(tokenizer, max_model_len=10_000)
    stream._pieces = {}
    window = Detokenizer(tokenizer, max_model_len=10_000)
    window._backend, window._pieces = None, {}
    assert table._pieces and stream._backend is not None
    prompt = tokenizer("Once upon a time")["input_ids"]
    output = tokenizer("there was a café in Zürich, 東京 too 🙂, and\n  a   space")["input_ids"] + [tokenizer.eos_token_id] + \
        tokenizer(" after the end")["input_ids"]
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    states = [feed(detok, tokenizer, prompt, output, params)[1] for detok in (table, stream, window)]
    assert states[1].stream is not None and states[2].stream is None
    texts = [unsent_text(state) for state in states]
    assert texts[0] == texts[1] == texts[2] == tokenizer.decode(output, skip_special_tokens=True)


def test_piece_table_gives_a_streams_text_token_by_token(tokenizer):
    """Byte-level BPE: the piece table (with a stream only inside characters) against one
    DecodeStream stepped through every output token, on random ids weighted towards pieces of
    characters, specials and U+FFFD pieces, the text handed out compared after every token."""
    from tokenizers.decoders import DecodeStream

    detok = Detokenizer(tokenizer, max_model_len=100_000)
    backend = tokenizer.backend_tokenizer
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    partial = [i for i in range(vocab_size) if i not in detok._pieces]
    specials = list(tokenizer.all_special_ids)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    streamed_through = 0
    for _ in range(40):
        prompt = [rng.choice(partial) for _ in range(rng.randrange(1, 4))]  # ends inside a character
        request = Request("r", prompt, params, seed=0, eos_token_id=tokenizer.eos_token_id)
        state, reference = detok.new_state(request), DecodeStream(skip_special_tokens=True)
        text = handed_out = ""
        for _ in range(60):
            token = rng.choice([rng.randrange(vocab_size), rng.choice(partial), rng.choice(specials)])
            request.output_token_ids.append(token)
            assert detok.advance(request, state) is None
            text += reference.step(backend, token) or ""
            handed_out += take_text_delta(state, finished=False)
            assert handed_out == text
            streamed_through += state.stream is not None
    assert streamed_through > 100  # the stream path was exercised, not only the table


def sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer (spaces as U+2581, byte fallback, leading space stripped):
    no piece table, every sample decodes through a primed DecodeStream."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581Hello", "\u2581world", "\u2581a", "\u2581"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", clean_up_tokenization_spaces=False)


def test_a_prompt_ending_inside_a_character_lends_no_text_to_the_output():
    """A DecodeStream primed with text that ends in U+FFFD would hand the prompt's tail out
    with the first delta ("rld " here); the primed context stops before the split character."""
    tokenizer = sentencepiece_style_tokenizer()
    detok = Detokenizer(tokenizer, max_model_len=1000)
    assert not detok._pieces and detok._backend is not None
    ids = tokenizer("Hello world 東")["input_ids"]  # 東 is three byte-fallback tokens
    prompt, a = ids[:-1], tokenizer.convert_tokens_to_ids("\u2581a")
    _, state, _ = feed(detok, tokenizer, prompt, [ids[-1], a], SamplingParams(max_tokens=10))
    assert unsent_text(state) == "\ufffd a"
    _, state, _ = feed(detok, tokenizer, ids, [a, a], SamplingParams(max_tokens=10))  # a whole prompt
    assert unsent_text(state) == " a a"
