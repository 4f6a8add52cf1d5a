"""How the ranks' answers to one step combine: the adapters any rank failed to write are
merged (each once), while a step error on some ranks only is still fatal."""
import pytest

from tpu_executor.core.step import LoRAFailure, ModelRunnerOutput, SampledTokens
from tpu_executor.executor.base import WorkerFailure, agree_on_step


def test_adapter_failures_of_any_rank_are_merged_once():
    tokens = SampledTokens(["base", "r1"], [5, 7], [0.0, 0.0])
    b_on_rank_1 = LoRAFailure(1, 2, "LoRA adapter 'b' could not be loaded: no adapter_config.json")
    outputs = [ModelRunnerOutput(tokens),
               ModelRunnerOutput(tokens, lora_failures=(b_on_rank_1,)),
               ModelRunnerOutput(tokens, lora_failures=(LoRAFailure(1, 2, "rank 2's words"), LoRAFailure(3, 4, "d")))]
    merged = agree_on_step(outputs)
    assert merged.sampled == tokens and merged.error is None
    assert merged.lora_failures == (b_on_rank_1, LoRAFailure(3, 4, "d"))
    assert agree_on_step(outputs[:1]) is outputs[0]


def test_a_step_error_on_one_rank_only_is_still_fatal():
    with pytest.raises(WorkerFailure, match="rank 1: RuntimeError: device fell over"):
        agree_on_step([ModelRunnerOutput(), ModelRunnerOutput(error="RuntimeError: device fell over")])
