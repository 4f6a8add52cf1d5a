"""The engine's front-end builds every delta from what its core reports, and nothing else: a
scripted core stands in for ``EngineCore`` and hands out ``CoreOutput``s, including tokens
that arrive after the front-end ended a sample (as from a core that runs a step ahead)."""
import pytest
from transformers import AutoTokenizer

from tpu_executor.bench.host import tiny_checkpoint
from tpu_executor.core.request import RequestStatus
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.core.step import SampledTokens
from tpu_executor.engine.core import CoreOutput, Finished
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.engine.options import build_engine_config


class ScriptedCore:
    """Hands out the given outputs, one per step, and records what the front-end tells it."""

    vocab_size = 100
    dead_reason = None
    num_waiting = 0

    def __init__(self, outputs, config):
        self.outputs, self.config = list(outputs), config
        self.added, self.finished = [], []

    def add(self, samples):
        self.added += [sample.request_id for sample in samples]

    def finish(self, sample_ids, status):
        self.finished.append((list(sample_ids), status))

    def step(self):
        return self.outputs.pop(0) if self.outputs else CoreOutput()

    def has_unfinished(self):
        return bool(self.outputs)

    def has_sample(self, sample_id):
        return False


@pytest.fixture(scope="module")
def checkpoint():
    path = tiny_checkpoint()
    return build_engine_config(path, device="cpu"), AutoTokenizer.from_pretrained(path)


def tokens(*rows):
    """A CoreOutput's tokens from (sample id, token id) rows."""
    return SampledTokens([r for r, _ in rows], [t for _, t in rows], [-0.5] * len(rows))


def run(checkpoint, outputs, params, abort_after=None):
    """Each delta's (text, token ids, finish reason, stop reason), and the core."""
    config, tokenizer = checkpoint
    core = ScriptedCore(outputs, config)
    engine = LLMEngine(config, tokenizer, core=core)
    engine.add_request({"prompt_token_ids": [5, 6]}, params, request_id="r")
    deltas = []
    for step in range(len(outputs) + 1):
        if step == abort_after:
            engine.abort_request("r")
        deltas += [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for d in engine.step() for c in d.outputs]
    assert not engine.has_unfinished_requests() and core.added == ["r"]
    return deltas, core


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokens_after_a_stop_string_are_dropped_and_the_core_is_told_once(checkpoint):
    _, tokenizer = checkpoint
    ids = ids_of(tokenizer, "one two STOP three four")
    outputs = [CoreOutput(tokens(("r", t))) for t in ids]  # the core goes on past the stop string
    deltas, core = run(checkpoint, outputs, SamplingParams(max_tokens=50, stop=["STOP"]))
    assert "".join(d[0] for d in deltas) == "one two "
    assert deltas[-1][2:] == ("stop", "STOP")
    handed_out = [t for d in deltas for t in d[1]]
    assert handed_out == ids[:len(handed_out)] and len(handed_out) < len(ids)
    assert core.finished == [(["r"], RequestStatus.FINISHED_STOPPED)]


def test_a_stop_string_wins_over_a_length_limit_on_the_same_token(checkpoint):
    _, tokenizer = checkpoint
    ids = ids_of(tokenizer, "ab STOP")
    outputs = [CoreOutput(tokens(("r", t))) for t in ids[:-1]]
    outputs.append(CoreOutput(tokens(("r", ids[-1])), {"r": Finished("length")}))
    deltas, _ = run(checkpoint, outputs, SamplingParams(max_tokens=len(ids), stop=["STOP"]))
    assert "".join(d[0] for d in deltas) == "ab " and deltas[-1][2:] == ("stop", "STOP")


def test_a_stop_token_ends_the_sample_with_its_text_unsearched(checkpoint):
    _, tokenizer = checkpoint
    ids = ids_of(tokenizer, "ab STOP")
    outputs = [CoreOutput(tokens(("r", t))) for t in ids[:-1]]
    outputs.append(CoreOutput(tokens(("r", ids[-1])), {"r": Finished("stop", ids[-1])}))
    deltas, core = run(checkpoint, outputs, SamplingParams(max_tokens=50, stop=["STOP"],
                                                           stop_token_ids=[ids[-1]]))
    assert "".join(d[0] for d in deltas) == tokenizer.decode(ids) and deltas[-1][2:] == ("stop", ids[-1])
    assert core.finished == []  # the core ended it itself


def test_an_abort_hands_out_one_last_delta_and_drops_tokens_still_coming(checkpoint):
    _, tokenizer = checkpoint
    ids = ids_of(tokenizer, "one two three four")
    outputs = [CoreOutput(tokens(("r", t))) for t in ids]
    deltas, core = run(checkpoint, outputs, SamplingParams(max_tokens=50), abort_after=2)
    assert [t for d in deltas for t in d[1]] == ids[:2]
    assert deltas[-1][2] == "abort" and core.finished == [(["r"], RequestStatus.FINISHED_ABORTED)]


def test_an_error_reported_by_the_core_ends_the_request_with_it(checkpoint):
    config, tokenizer = checkpoint
    outputs = [CoreOutput(tokens(("r", 7))), CoreOutput(finished={"r": Finished("error", None, "boom")})]
    core = ScriptedCore(outputs, config)
    engine = LLMEngine(config, tokenizer, core=core)
    engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=50, logprobs=0), request_id="r")
    first, [last] = engine.step(), engine.step()
    assert first[0].outputs[0].token_ids == [7] and first[0].outputs[0].cumulative_logprob == -0.5
    assert last.finished and last.error == "boom" and last.outputs[0].finish_reason == "error"
