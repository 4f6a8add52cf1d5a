"""SamplingParams validation: every invalid value names its field."""
import pytest

from tpu_executor import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("n", 0), ("seed", -1), ("logprobs", -1), ("stop", [""]),
    ("stop_token_ids", [-3]),
    # Bounds: nothing past an int32 row slot, nothing that turns the sampler's -inf into NaN.
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", 1e39), ("temperature", 101.0),
    ("top_k", 10**20), ("top_p", float("nan")), ("min_p", float("nan")), ("presence_penalty", float("inf")),
    ("frequency_penalty", float("nan")), ("repetition_penalty", float("inf")), ("stop_token_ids", [2**40]),
    ("stop", ["x"] * 33), ("stop", ["x" * 1025]), ("logit_bias", {3: float("nan")}),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_normalisation():
    params = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert params.stop == ("END",) and params.top_k == 0 and params.is_greedy
