"""Trace readers: every supported layout, clear errors naming the line, seeded synthetic traces."""
import json
import statistics

import pytest

from tpu_executor.tuning.traces import SYNTHETIC, TraceError, TraceRequest, load_trace


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_jsonl_with_our_names_and_mooncake_names(tmp_path):
    ours = write(tmp_path, "a.jsonl", '{"prompt_len": 10, "output_len": 3}\n\n{"prompt_len": 7, "output_len": 2}\n')
    assert load_trace(ours) == [TraceRequest(10, 3), TraceRequest(7, 2)]
    moon = write(tmp_path, "m.jsonl", '{"timestamp": 1000, "input_length": 50, "output_length": 5, "hash_ids": [1]}\n'
                                      '{"timestamp": 3500, "input_length": 60, "output_length": 6, "hash_ids": [2]}\n')
    assert load_trace(moon) == [TraceRequest(50, 5, 0.0), TraceRequest(60, 6, 2.5)]


def test_azure_and_burstgpt_csv(tmp_path):
    azure = write(tmp_path, "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                         "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.1805900,396,109\n")
    assert load_trace(azure) == [TraceRequest(374, 44, 0.0), TraceRequest(396, 109, 3.5)]
    burst = write(tmp_path, "burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                         "5,ChatGPT,472,18,490,Conversation log\n"
                                         "9,ChatGPT,1087,0,1087,Conversation log\n"  # failed: skipped
                                         "12,GPT-4,300,40,340,API log\n")
    assert load_trace(burst) == [TraceRequest(472, 18, 0.0), TraceRequest(300, 40, 7.0)]


def test_sharegpt_json_is_tokenized_with_the_model_tokenizer(tmp_path):
    class Words:
        def __call__(self, text):
            return {"input_ids": text.split()}
    conversations = [{"conversations": [{"from": "human", "value": "a b c"}, {"from": "gpt", "value": "d e"}]},
                     {"conversations": [{"from": "human", "value": "only a question"}]}]
    path = write(tmp_path, "share.json", json.dumps(conversations))
    assert load_trace(path, tokenizer=Words()) == [TraceRequest(3, 2)]
    with pytest.raises(TraceError, match="tokenized with the model's tokenizer"):
        load_trace(path)


@pytest.mark.parametrize("text, message", [
    ('{"prompt_len": 10, "output_len": 3}\nnot json\n', r"a\.jsonl:2: not JSON"),
    ('{"prompt_len": 0, "output_len": 3}\n', r"a\.jsonl:1: prompt_len must be >= 1"),
    ('{"prompt_len": "ten", "output_len": 3}\n', r"a\.jsonl:1: .*unreadable"),
    ('{"prompt": "hello"}\n', r"a\.jsonl:1: no length columns"),
    ('[1, 2]\n', r"a\.jsonl:1: expected a JSON object"),
])
def test_bad_rows_name_their_line(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, "a.jsonl", text))


def test_unknown_sources_and_empty_files_are_refused(tmp_path):
    with pytest.raises(TraceError, match="neither a file nor one of"):
        load_trace("no-such-trace")
    with pytest.raises(TraceError, match="unknown extension"):
        load_trace(write(tmp_path, "t.parquet", "x"))
    with pytest.raises(TraceError, match="holds no requests"):
        load_trace(write(tmp_path, "e.jsonl", "\n"))


def test_long_requests_are_cut_to_fit_the_context(tmp_path):
    path = write(tmp_path, "a.jsonl",
                 '{"prompt_len": 900, "output_len": 300}\n{"prompt_len": 100, "output_len": 900}\n')
    assert load_trace(path, max_model_len=512) == [TraceRequest(511, 1), TraceRequest(100, 412)]


def test_synthetic_traces_are_seeded_fit_and_imitate_their_published_means():
    trace = load_trace("sharegpt-like", num_requests=4000, max_model_len=4096, seed=3)
    assert trace == load_trace("sharegpt-like", num_requests=4000, max_model_len=4096, seed=3)
    assert trace != load_trace("sharegpt-like", num_requests=4000, max_model_len=4096, seed=4)
    assert all(r.prompt_len + r.output_len <= 4096 and r.output_len >= 1 for r in trace)
    # Published means: 161 prompt and 338 output tokens (the cap at 4096 trims a little).
    assert statistics.mean(r.prompt_len for r in trace) == pytest.approx(161, rel=0.1)
    assert statistics.mean(r.output_len for r in trace) == pytest.approx(338, rel=0.1)
    assert set(SYNTHETIC) == {"sharegpt-like", "chat", "long-prompt"}
