"""Multi-LoRA when an adapter fails at run time (native path, one slot): an adapter whose
weight file a worker cannot read, or finds non-finite, when it loads it fails only its own
requests, naming it (never its path); the base model's and the other adapter's requests in the
same steps keep a clean run's tokens. Its slot is read back empty; once the file is sound
again a request reads it again and the slot holds its real weights; unloading empties the
slot. With two workers (ranks), one that cannot read it fails its requests, not the engine,
and both end with the same slots."""
import contextlib
import math
import os
import re

import pytest
import torch

from tests.common import mixed_prompts, tiny_engine_options
from tpu_executor import LLM, LoRARequest, SamplingParams
from tpu_executor.core.lora import WEIGHTS_FILE
from tpu_executor.tools.lora_adapter import write_random_lora_adapter
from tpu_executor.worker.lora_loader import check_adapter, lora_layers, read_adapter

PROMPTS = mixed_prompts(5, 8, 30, vocab=500, seed=5)
BASE_TOKENS, ADAPTER_TOKENS = 20, 6  # the base request still decodes when the adapters' turn comes


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    """Adapters a (id 1) and b (id 2) of the tiny Llama."""
    root = tmp_path_factory.mktemp("failing_adapters")
    return [LoRARequest(name, i + 1, write_random_lora_adapter(checkpoints["llama"], str(root / name), seed=i))
            for i, name in enumerate("ab")]


def requests_of(adapters):
    """The base model's request (long) and two short ones of each adapter, a's before b's."""
    a, b = adapters
    params = [SamplingParams(temperature=0, max_tokens=BASE_TOKENS, ignore_eos=True)] + \
        [SamplingParams(temperature=0, max_tokens=ADAPTER_TOKENS, ignore_eos=True)] * 4
    return [{"prompt_token_ids": p} for p in PROMPTS], params, [None, a, a, b, b]


def one_slot_llm(base, **options):
    return LLM(model=base, device="cpu", enable_lora=True, max_loras=1, **tiny_engine_options(**options))


def slot_contents(llm, slot):
    """Every adapter layer's A and B of ``slot``, as the model reads them."""
    worker = llm.engine.core.executor.workers[0]
    return [(layer.lora_a[slot].clone(), layer.lora_b[slot].clone()) for layer in lora_layers(worker.model)]


def assert_slot(contents, expected=None):
    """``contents`` equal ``expected``'s exactly, or are zero (None)."""
    for index, (lora_a, lora_b) in enumerate(contents):
        want_a, want_b = expected[index] if expected else (torch.zeros_like(lora_a), torch.zeros_like(lora_b))
        assert torch.equal(lora_a, want_a) and torch.equal(lora_b, want_b), index


def run_after_a(llm, adapters):
    """One request of a (slot 1 then holds a), then every request of ``requests_of``: the
    base's and a's are admitted at once, b's wait for the slot until a's finish."""
    prompts, params, loras = requests_of(adapters)
    lora_tokens(llm, prompts[1:2], params[1:2], loras[1:2])
    return llm.generate(prompts, params, use_tqdm=False, lora_request=loras)


@pytest.fixture(scope="module")
def clean_run(checkpoints, adapters):
    """The requests' tokens on sound files, and slot 1 once it holds b."""
    llm = one_slot_llm(checkpoints["llama"])
    outputs = run_after_a(llm, adapters)
    assert all(o.error is None for o in outputs)
    contents = slot_contents(llm, 1)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], contents


@contextlib.contextmanager
def broken(adapter_dir: str, kind: str):
    """The adapter's weight file made unreadable ("garbage") or holding a NaN in a lora_B
    ("nan"), restored on leaving."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(adapter_dir, WEIGHTS_FILE)
    with open(file, "rb") as f:
        sound = f.read()
    if kind == "garbage":
        with open(file, "wb") as f:
            f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    else:
        tensors = load_file(file)
        name = next(n for n in sorted(tensors) if "lora_B" in n)
        tensors[name][0, 0] = math.nan
        save_file(tensors, file)
    try:
        yield
    finally:
        with open(file, "wb") as f:
            f.write(sound)


@pytest.mark.parametrize("kind,async_scheduling", [("garbage", False), ("garbage", True), ("nan", False)])
def test_an_adapter_that_fails_to_load_fails_only_its_requests_and_loads_again_later(
        checkpoints, adapters, clean_run, kind, async_scheduling):
    """b's file is unreadable (or holds a NaN) when the worker first loads b into the slot a
    held: b's requests fail naming b, the base's and a's give a clean run's tokens, and slot 1
    reads back (a) empty; with the file sound, b's requests read it again and give b's tokens,
    the slot holding (b) b's weights; after b is unloaded, (c) the slot is zero."""
    expected, clean_slot = clean_run
    llm = one_slot_llm(checkpoints["llama"], async_scheduling=async_scheduling)
    b = adapters[1]
    prompts, params, loras = requests_of(adapters)
    llm.engine.checks.lora(b)  # loaded (checked by the front-end) while its file is sound
    with broken(b.lora_path, kind):
        outputs = run_after_a(llm, adapters)
        assert_slot(slot_contents(llm, 1))  # (a) b's failed read left the slot empty, not holding a
    assert [o.outputs[0].token_ids for o in outputs[:3]] == expected[:3]  # the base and a, exactly
    assert [o.error for o in outputs[:3]] == [None] * 3
    for output in outputs[3:]:
        assert output.error.startswith("LoRA adapter 'b' could not be loaded: ")
        assert b.lora_path not in output.error and os.path.dirname(b.lora_path) not in output.error
    # The file is sound again: b is read again, its slot holds its weights (b), its tokens come.
    assert lora_tokens(llm, prompts[3:], params[3:], loras[3:]) == expected[3:]
    assert_slot(slot_contents(llm, 1), clean_slot)
    llm.engine.core.forget_lora(b.lora_int_id)  # unloaded: the next step empties its slot (c)
    assert lora_tokens(llm, prompts[:1], params[:1], [None]) == expected[:1]
    assert_slot(slot_contents(llm, 1))
    assert llm.stats().lora_slots_in_use == 0 and llm.stats().kv_blocks_used == 0
    llm.shutdown()


def lora_tokens(llm, prompts, params, loras):
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


class EngineLLM(LLM):
    """``LLM`` over an engine built here."""

    def __init__(self, engine):
        self.engine = engine


def test_two_ranks_one_cannot_read_an_adapter(checkpoints, adapters, clean_run):
    """Two workers in one process (as ranks of one group): the second cannot read b (its host
    lacks the file). b's requests fail naming b, the base's and a's keep their tokens, the
    engine goes on, and both workers end with slot 1 empty; once the second can read b, b's
    requests get b's tokens and both slots hold b."""
    from transformers import AutoTokenizer

    from tpu_executor.engine.llm_engine import LLMEngine
    from tpu_executor.engine.options import build_engine_config
    from tpu_executor.executor.uniproc import UniprocExecutor
    from tpu_executor.worker.worker import Worker

    expected, clean_slot = clean_run
    base, b = checkpoints["llama"], adapters[1]
    options = tiny_engine_options()
    show_progress = options.pop("show_progress")
    config = build_engine_config(base, device="cpu", enable_lora=True, max_loras=1, **options)
    executor = UniprocExecutor(config)
    executor.workers.append(Worker(config))
    tokenizer = AutoTokenizer.from_pretrained(base)
    llm = EngineLLM(LLMEngine(config, tokenizer, executor=executor, show_progress=show_progress))
    second = executor.workers[1]
    missing = {b.lora_int_id}

    def read_on_second_host(lora, read=second.adapters._adapter):
        if lora.lora_int_id in missing:
            raise ValueError(f"LoRA adapter {lora.lora_path!r} has no adapter_config.json: not a PEFT adapter")
        return read(lora)

    second.adapters._adapter = read_on_second_host
    prompts, params, loras = requests_of(adapters)
    outputs = run_after_a(llm, adapters)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == expected[:3]
    assert [o.error for o in outputs[3:]] == ["LoRA adapter 'b' could not be loaded: LoRA adapter 'b' has no "
                                              "adapter_config.json: not a PEFT adapter"] * 2
    assert lora_tokens(llm, prompts[:1], params[:1], [None]) == expected[:1]  # the engine serves on
    for worker in executor.workers:
        assert all(not layer.lora_a[1].any() and not layer.lora_b[1].any() for layer in lora_layers(worker.model))
    missing.clear()
    assert lora_tokens(llm, prompts[3:], params[3:], loras[3:]) == expected[3:]
    for worker in executor.workers:
        assert_slot([(layer.lora_a[1], layer.lora_b[1]) for layer in lora_layers(worker.model)], clean_slot)
    llm.shutdown()


@pytest.mark.parametrize("change,problem", [
    ("nan_b", "model.layers.1.self_attn.o_proj's lora_B holds values that are not finite"),
    ("inf_a", "model.layers.0.mlp.down_proj's lora_A holds values that are not finite"),
    ("nan_alpha", "lora_alpha must be a finite number, got nan"),
    ("inf_pattern", "alpha_pattern['down_proj'] must be a finite number, got inf"),
])
def test_non_finite_adapters_are_refused_by_the_check_and_the_worker_read(checkpoints, tmp_path, change, problem):
    """A NaN or infinity in a weight, or as lora_alpha or an alpha_pattern value: the front-end's
    check (a 400 in the server) and the workers' read both refuse it, naming the module."""
    import json

    from safetensors.torch import load_file, save_file

    base = checkpoints["llama"]
    path = write_random_lora_adapter(base, str(tmp_path / "bad"), rank=4, alpha_pattern={"down_proj": 4.0})
    file, config_file = os.path.join(path, WEIGHTS_FILE), os.path.join(path, "adapter_config.json")
    if change in ("nan_b", "inf_a"):
        tensors = load_file(file)
        name = ("base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight" if change == "nan_b"
                else "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
        tensors[name][1, 2] = math.nan if change == "nan_b" else -math.inf
        save_file(tensors, file)
    else:
        with open(config_file) as f:
            config = json.load(f)
        if change == "nan_alpha":
            config["lora_alpha"] = math.nan
        else:
            config["alpha_pattern"] = {"down_proj": math.inf}
        with open(config_file, "w") as f:
            json.dump(config, f)  # NaN and Infinity: what Python's json writes and reads
    with open(os.path.join(base, "config.json")) as f:
        model_config = json.load(f)
    with pytest.raises(ValueError, match=re.escape(problem)):
        check_adapter(path, model_config, max_rank=16)
    with pytest.raises(ValueError, match=re.escape(problem)):
        read_adapter(path)


def test_a_slot_refuses_an_adapter_its_dtype_cannot_hold():
    """A finite A beyond float16's range, or a B that its scale takes past it: the layer refuses
    it, naming the scale, and writes nothing."""
    from tpu_executor.models.layers.linear import RowParallelLinear
    from tpu_executor.models.layers.parallel import SingleRank

    layer = RowParallelLinear(8, 6, SingleRank())
    layer.enable_lora(num_slots=2, max_rank=4, dtype=torch.float16)
    lora_a, lora_b = torch.full((4, 8), 0.5), torch.full((6, 4), 0.5)
    for a, b, scale in ((lora_a * 1e6, lora_b, 2.0), (lora_a, lora_b, 1e6)):
        message = f"its A, or its B scaled by {scale:g}, is not finite in torch.float16"
        with pytest.raises(ValueError, match=re.escape(message)):
            layer.set_lora(1, None, a, b, scale)
        assert not layer.lora_a_host.any() and not layer.lora_b_host.any()
    layer.set_lora(1, None, lora_a, lora_b, 2.0)
    assert torch.equal(layer.lora_b_host[1], torch.ones(4, 6, dtype=torch.float16))
