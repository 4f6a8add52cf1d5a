"""A PEFT ``adapter_config.json`` that is valid JSON but not what PEFT writes is refused with a
ValueError naming the key (a server answers it 400), never a TypeError, re.error or
AttributeError (a 500): checked over hand-picked shapes, and by hypothesis over mutations of a
valid config."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_executor.core.lora import CONFIG_FILE, MAX_CONFIG_BYTES, AdapterConfig

VALID = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
         "use_rslora": False, "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 32.0}, "bias": "none",
         "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False,
         "task_type": "CAUSAL_LM", "base_model_name_or_path": "base"}
MODULES = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"]


def test_a_peft_config_is_read_with_its_patterns():
    config = AdapterConfig.parse(VALID, "a")
    assert (config.r, config.lora_alpha, config.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    assert [config.rank_of(m) for m in MODULES] == [4, 8, 8]
    assert [config.scale_of(m) for m in MODULES] == [4.0, 4.0, 2.0]
    assert AdapterConfig.parse({**VALID, "target_modules": "q_proj|v_proj"}).target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("raw, message", [
    ([VALID], "adapter_config.json must hold a JSON object, got list"),
    ("LORA", "adapter_config.json must hold a JSON object, got str"),
    (8, "adapter_config.json must hold a JSON object, got int"),
    (None, "adapter_config.json must hold a JSON object, got NoneType"),
    ({**VALID, "rank_pattern": {"q_proj": None}}, "rank_pattern['q_proj'] must be an integer in [1, 65536], got None"),
    ({**VALID, "rank_pattern": {"q_proj": "4"}}, "rank_pattern['q_proj'] must be an integer in [1, 65536], got '4'"),
    ({**VALID, "rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj'] must be an integer in [1, 65536], got 0"),
    ({**VALID, "rank_pattern": ["q_proj"]}, "rank_pattern must be an object of module patterns, got ['q_proj']"),
    ({**VALID, "rank_pattern": {"q_proj(": 4}}, "rank_pattern key 'q_proj(' is not a valid regular expression"),
    ({**VALID, "rank_pattern": {"(?i)q": 4}}, "rank_pattern key '(?i)q' is not a valid regular expression"),
    ({**VALID, "alpha_pattern": {"v_proj": "big"}}, "alpha_pattern['v_proj'] must be a number, got 'big'"),
    ({**VALID, "alpha_pattern": {"v_proj": True}}, "alpha_pattern['v_proj'] must be a number, got True"),
    ({**VALID, "alpha_pattern": {"v_proj": math.nan}}, "alpha_pattern['v_proj'] must be a finite number, got nan"),
    ({**VALID, "alpha_pattern": {"[": 1.0}}, "alpha_pattern key '[' is not a valid regular expression"),
    ({**VALID, "target_modules": 7}, "target_modules must be a list of module names or a regular expression, got 7"),
    ({**VALID, "target_modules": ["q_proj", 3]}, "target_modules must be a list of module names"),
    ({**VALID, "target_modules": {"q_proj": 1}}, "target_modules must be a list of module names"),
    ({**VALID, "target_modules": "q_proj("}, "target_modules 'q_proj(' is not a valid regular expression"),
    ({**VALID, "r": "8"}, "r must be an integer in [1, 65536], got '8'"),
    ({**VALID, "r": 8.0}, "r must be an integer in [1, 65536], got 8.0"),
    ({**VALID, "r": True}, "r must be an integer in [1, 65536], got True"),
    ({**VALID, "r": 10 ** 400}, "r must be an integer in [1, 65536], got 1000"),
    ({k: v for k, v in VALID.items() if k != "r"}, "r must be an integer in [1, 65536], got None"),
    ({**VALID, "lora_alpha": "16"}, "lora_alpha must be a number, got '16'"),
    ({**VALID, "lora_alpha": [16]}, "lora_alpha must be a number, got [16]"),
    ({**VALID, "lora_alpha": math.inf}, "lora_alpha must be a finite number, got inf"),
    ({**VALID, "lora_alpha": -math.inf}, "lora_alpha must be a finite number, got -inf"),
    ({**VALID, "lora_alpha": 10 ** 400}, "lora_alpha must be a finite number, got 1000"),
    ({**VALID, "use_rslora": "yes"}, "use_rslora must be true or false, got 'yes'"),
    ({**VALID, "use_rslora": None}, "use_rslora must be true or false, got None"),
    ({**VALID, "peft_type": ["LORA"]}, "is a ['LORA'] adapter (peft_type)"),
    ({**VALID, "bias": {"all": 1}}, "trains biases (bias={'all': 1})"),
    ({**VALID, "use_dora": True}, "uses DoRA"),
])
def test_a_malformed_config_is_a_value_error_naming_the_key(raw, message):
    with pytest.raises(ValueError) as err:
        AdapterConfig.parse(raw, "a")
    assert type(err.value) is ValueError
    assert message in str(err.value)
    assert str(err.value).startswith("LoRA adapter 'a'")


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", "must hold a JSON object, got list"),
    (b'{"r": NaN, "lora_alpha": 1}', "r must be an integer in [1, 65536], got nan"),
    (b'{"r": 8, "lora_alpha": Infinity}', "lora_alpha must be a finite number, got inf"),
    (b'{"r": 8, "rank_pattern": {"q": null}}', "rank_pattern['q'] must be an integer"),
    (b"\xff\xfe\x00garbage", "adapter_config.json is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "adapter_config.json is not valid JSON"),
    (b'{"r": ' + b"9" * 5000 + b"}", "adapter_config.json is not valid JSON"),
    (b" " * (MAX_CONFIG_BYTES + 1), f"adapter_config.json is over {MAX_CONFIG_BYTES} bytes"),
], ids=["list", "nan rank", "infinite alpha", "null pattern", "not utf-8", "deep", "many digits", "huge"])
def test_a_malformed_file_is_a_value_error(tmp_path, content, message):
    (tmp_path / CONFIG_FILE).write_bytes(content)
    with pytest.raises(ValueError, match="^LoRA adapter ") as err:
        AdapterConfig.read(str(tmp_path))
    assert message in str(err.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 1100, 2 ** 1100) | st.floats() | st.text(max_size=8)
    | st.sampled_from(["LORA", "none", "q_proj", "(", "[a-", ".*", "(?i)x", "q_proj|v_proj"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=6) | st.sampled_from(["q_proj", "(", "*", "v_proj"]), children, max_size=4),
    max_leaves=8)


@st.composite
def mutated_configs(draw):
    """A valid PEFT config with keys dropped, set to any JSON value, or values nested in its
    patterns replaced; or any JSON value at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    raw = json.loads(json.dumps(VALID))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(VALID)))
        kind = draw(st.sampled_from(["drop", "set", "pattern"]))
        if kind == "drop":
            raw.pop(key, None)
        elif kind == "set":
            raw[key] = draw(json_values)
        else:
            pattern_key = draw(st.sampled_from(["rank_pattern", "alpha_pattern"]))
            raw[pattern_key] = {draw(st.text(max_size=6) | st.sampled_from(["q_proj", "(", "v_proj"])):
                                draw(json_values)}
    return raw


@settings(max_examples=400, deadline=None)
@given(mutated_configs())
def test_only_value_errors_come_out_of_parse(raw):
    try:
        config = AdapterConfig.parse(raw, "a")
    except ValueError as err:
        assert type(err) is ValueError and str(err).startswith("LoRA adapter 'a'")
        return
    # What parse accepts, the loader can use: every rank and scale is computable and finite.
    assert config.max_rank() >= 1
    for module in MODULES:
        assert config.rank_of(module) >= 1 and math.isfinite(config.scale_of(module))
