"""Incremental detokenization equals a full decode; stop strings cut the text; the byte-level
piece table equals a DecodeStream token by token. (Stop tokens and lengths are the scheduler's:
tests/tpu_executor/core/test_scheduler.py.)"""
import random

import pytest
from transformers import AutoTokenizer

from tpu_executor.core.detokenizer import Detokenizer, take_text_delta, truncate_at_stop
from tpu_executor.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def unsent_text(state) -> str:
    """All the text a state holds (the tests below take no deltas until they say so)."""
    return "".join(state.unsent)


def feed(detok, prompt, output_ids, params):
    """Add ``output_ids`` one by one until one completes a stop string; the state and that stop."""
    state = detok.new_state(list(prompt), params)
    for token in output_ids:
        new_text = detok.add_token(state, token)
        if new_text and state.stops and (stop := truncate_at_stop(state, new_text)) is not None:
            return state, stop
    return state, None


@pytest.mark.parametrize("text", ["Hello world, ça va? 東京は晴れ 🙂 done", "  spaced   out\n\nlines"])
def test_incremental_text_equals_full_decode(tokenizer, text):
    detok = Detokenizer(tokenizer)
    prompt = tokenizer("Say:")["input_ids"]
    output = tokenizer(text)["input_ids"]
    state, _ = feed(detok, prompt, output, SamplingParams(max_tokens=500))
    assert unsent_text(state) == tokenizer.decode(output, skip_special_tokens=True)


def test_stop_string_truncates_and_stops(tokenizer):
    detok = Detokenizer(tokenizer)
    output = tokenizer("one two three STOP four five")["input_ids"]
    state, stop = feed(detok, [1], output, SamplingParams(stop=["STOP"], max_tokens=100))
    assert stop == "STOP"
    assert unsent_text(state) == "one two three "
    state, _ = feed(detok, [1], output, SamplingParams(stop="STOP", include_stop_str_in_output=True))
    assert unsent_text(state) == "one two three STOP"


@pytest.mark.parametrize("include_stop", [False, True])
def test_deltas_add_up_to_the_text_cut_at_its_stop_string(tokenizer, include_stop):
    """Random texts, each with a stop string cut from it (or one it lacks) and an absent longer
    one: deltas taken at random moments, then a last one, add up to the text cut where the
    stop string first occurs (after it, with include_stop_str_in_output), or the whole text.
    A delta is never taken back, so this also shows the hold-back kept every cut unsent."""
    detok = Detokenizer(tokenizer)
    words = ["alpha", " beta", "gamma ", "STOP", "東京", "🙂", "\n", "x", "ST", "OP", "é"]
    rng = random.Random(1)
    for _ in range(80):
        ids = tokenizer("".join(rng.choice(words) for _ in range(rng.randrange(3, 25))))["input_ids"]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randrange(1, 6)] if rng.random() < 0.8 else "absent"
        stops = [stop, "QQQQQQQQ"] if rng.random() < 0.5 else ["QQQQQQQQ", stop]
        params = SamplingParams(max_tokens=len(ids), stop=stops, include_stop_str_in_output=include_stop)
        state, handed_out, found = detok.new_state([1], params), "", None
        for token in ids:
            new_text = detok.add_token(state, token)
            if new_text and (found := truncate_at_stop(state, new_text)) is not None:
                break
            if rng.random() < 0.6:
                handed_out += take_text_delta(state, finished=False)
        handed_out += take_text_delta(state, finished=True)
        at = full.find(stop)
        expected = full if at == -1 else full[:at + (len(stop) if include_stop else 0)]
        assert handed_out == expected, (full, stops)
        assert (found == stop) == (at != -1)


def test_table_stream_and_window_paths_give_the_same_text(tokenizer):
    """The piece table (byte-level BPE), a DecodeStream per sample primed with the prompt (any
    fast tokenizer) and the two-decode window (any tokenizer) agree on a prompt of text."""
    table = Detokenizer(tokenizer)
    stream = Detokenizer(tokenizer)
    stream._pieces = {}
    window = Detokenizer(tokenizer)
    window._backend, window._pieces = None, {}
    assert table._pieces and stream._backend is not None
    prompt = tokenizer("Once upon a time")["input_ids"]
    output = (tokenizer("there was a café in Zürich, 東京 too 🙂, and\n  a   space")["input_ids"]
              + [tokenizer.eos_token_id] + tokenizer(" after the end")["input_ids"])
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    states = [feed(detok, prompt, output, params)[0] for detok in (table, stream, window)]
    assert states[1].stream is not None and states[2].stream is None
    texts = [unsent_text(state) for state in states]
    assert texts[0] == texts[1] == texts[2] == tokenizer.decode(output, skip_special_tokens=True)


def test_piece_table_gives_a_streams_text_token_by_token(tokenizer):
    """Byte-level BPE: the piece table (with a stream only inside characters) against one
    DecodeStream stepped through every output token, on random ids weighted towards pieces of
    characters, specials and U+FFFD pieces, the text handed out compared after every token."""
    from tokenizers.decoders import DecodeStream

    detok = Detokenizer(tokenizer)
    backend = tokenizer.backend_tokenizer
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    partial = [i for i in range(vocab_size) if i not in detok._pieces]
    specials = list(tokenizer.all_special_ids)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    streamed_through = 0
    for _ in range(40):
        prompt = [rng.choice(partial) for _ in range(rng.randrange(1, 4))]  # ends inside a character
        state, reference = detok.new_state(prompt, params), DecodeStream(skip_special_tokens=True)
        text = handed_out = ""
        for _ in range(60):
            token = rng.choice([rng.randrange(vocab_size), rng.choice(partial), rng.choice(specials)])
            detok.add_token(state, token)
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
    detok = Detokenizer(tokenizer)
    assert not detok._pieces and detok._backend is not None
    ids = tokenizer("Hello world 東")["input_ids"]  # 東 is three byte-fallback tokens
    prompt, a = ids[:-1], tokenizer.convert_tokens_to_ids("\u2581a")
    state, _ = feed(detok, prompt, [ids[-1], a], SamplingParams(max_tokens=10))
    assert unsent_text(state) == "\ufffd a"
    state, _ = feed(detok, ids, [a, a], SamplingParams(max_tokens=10))  # a whole prompt
    assert unsent_text(state) == " a a"
