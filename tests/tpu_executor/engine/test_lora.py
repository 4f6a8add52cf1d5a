"""Multi-LoRA on the native path: greedy tokens of several adapters and the base model in one
batch equal transformers + peft (the adapter applied, fp32); slots recycled when more adapters
run than there are slots; prefix caching kept apart per adapter; bad adapters refused."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tests.common import assert_same_outputs_over_random_requests, mixed_prompts, tiny_engine_options
from tpu_executor import LLM, LoRARequest, SamplingParams
from tpu_executor.tools.lora_adapter import write_random_lora_adapter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PROMPTS = mixed_prompts(5, 8, 40, vocab=500, seed=3)
NEW_TOKENS = 12
# Four adapters: every projection; attention only with a rank pattern; MLP only with rsLoRA and
# an alpha pattern; q and v only, rank 4.
ADAPTERS = [
    dict(rank=8, alpha=16),
    dict(rank=8, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), rank_pattern={"o_proj": 16}),
    dict(rank=16, alpha=4, targets=("gate_proj", "up_proj", "down_proj"), use_rslora=True,
         alpha_pattern={"down_proj": 32}),
    dict(rank=4, alpha=8, targets=("q_proj", "v_proj")),
]


MOE = ("mixtral", "qwen3_moe")  # adapters on their attention only (the experts take none)
ARCHS = ("llama", "llama3", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3")


class LazyAdapters(dict):
    """Each architecture's four adapters, written on first look-up."""

    def __init__(self, checkpoints, root):
        super().__init__()
        self.checkpoints, self.root = checkpoints, root

    def __missing__(self, arch):
        attention = ("q_proj", "k_proj", "v_proj", "o_proj")
        specs = [{**spec, "targets": attention} if arch in MOE and "targets" not in spec else spec for spec in ADAPTERS]
        specs = [spec for spec in specs if not (arch in MOE and set(spec["targets"]) - set(attention))]
        self[arch] = [write_random_lora_adapter(self.checkpoints[arch], str(self.root / f"{arch}{i}"), seed=i, **spec)
                      for i, spec in enumerate(specs)]
        return self[arch]


@pytest.fixture(scope="module")
def adapter_dirs(checkpoints, tmp_path_factory):
    return LazyAdapters(checkpoints, tmp_path_factory.mktemp("adapters"))


def peft_greedy(base: str, adapter: str, prompts, max_new_tokens: int):
    """transformers + peft greedy tokens (fp32), the adapter applied."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, adapter).eval() if adapter else model.eval()
    out = []
    for prompt in prompts:
        tokens = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def lora_greedy(llm, prompts, adapters, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapters)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", [a if a in ("llama", "qwen3") else pytest.param(a, marks=pytest.mark.slow)
                                  for a in ARCHS])
def test_adapters_and_the_base_in_one_batch_equal_peft(checkpoints, adapter_dirs, arch):
    """Each prompt under each of four adapters (three on a mixture of experts: its attention
    only) and the base model, all in one batch, equal transformers + peft; every adapter
    changes the tokens."""
    base, dirs = checkpoints[arch], adapter_dirs[arch]
    llm = LLM(model=base, device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16, **tiny_engine_options())
    requests = [None] + [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(dirs)]
    prompts = [p for p in PROMPTS for _ in requests]
    got = lora_greedy(llm, prompts, [r for _ in PROMPTS for r in requests], NEW_TOKENS)
    llm.shutdown()
    for index, request in enumerate(requests):
        expected = peft_greedy(base, request.lora_path if request else None, PROMPTS, NEW_TOKENS)
        assert got[index::len(requests)] == expected, request
    base_tokens = got[0::len(requests)]
    for index in range(1, len(requests)):
        assert got[index::len(requests)] != base_tokens  # the adapter changes the output
    assert len({t for tokens in base_tokens for t in tokens}) > 4  # context-dependent outputs


def test_more_adapters_than_slots_recycle_slots(checkpoints, adapter_dirs):
    """Four adapters over two slots: requests wait for a slot and every one still equals its
    adapter's tokens (from an engine with a slot per adapter)."""
    base, dirs = checkpoints["llama"], adapter_dirs["llama"]
    requests = [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(dirs)] * 2 + [None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(requests))]
    wide = LLM(model=base, device="cpu", enable_lora=True, max_loras=4, **tiny_engine_options())
    expected = lora_greedy(wide, prompts, requests, NEW_TOKENS)
    wide.shutdown()
    narrow = LLM(model=base, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=2, **tiny_engine_options())
    assert lora_greedy(narrow, prompts, requests, NEW_TOKENS) == expected
    narrow.shutdown()


def test_prefix_caching_never_shares_blocks_between_adapters(checkpoints, adapter_dirs):
    """The same long prompt under the base and an adapter, one after the other: the second
    takes no cached block of the first (its K/V differs), and equals its own fresh run."""
    base, dirs = checkpoints["llama"], adapter_dirs["llama"]
    prompt = mixed_prompts(1, 100, 100, vocab=500, seed=7)[0]
    adapter = LoRARequest("a0", 1, dirs[0])
    fresh = LLM(model=base, device="cpu", enable_lora=True, **tiny_engine_options())
    expected = lora_greedy(fresh, [prompt], [adapter], NEW_TOKENS)
    fresh.shutdown()
    llm = LLM(model=base, device="cpu", enable_lora=True, **tiny_engine_options())
    lora_greedy(llm, [prompt], [None], NEW_TOKENS)
    assert lora_greedy(llm, [prompt], [adapter], NEW_TOKENS) == expected
    assert llm.engine.core.kv_cache.find_cached_prefix(prompt, None)[1] > 0  # the base's blocks are cached
    llm.shutdown()


def test_bad_adapters_are_refused_naming_the_problem(checkpoints, adapter_dirs, tmp_path):
    base, dirs = checkpoints["llama"], adapter_dirs["llama"]
    llm = LLM(model=base, device="cpu", enable_lora=True, max_lora_rank=8, **tiny_engine_options())
    with open(os.path.join(base, "config.json")) as f:
        other_model = {**json.load(f), "intermediate_size": 96}  # another model's MLP width
    os.makedirs(tmp_path / "other_model")
    with open(tmp_path / "other_model" / "config.json", "w") as f:
        json.dump(other_model, f)
    other = write_random_lora_adapter(str(tmp_path / "other_model"), str(tmp_path / "other"), rank=4)
    dora = write_random_lora_adapter(base, str(tmp_path / "dora"), rank=4)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump({**config, "use_dora": True}, f)
    cases = [(LoRARequest("other", 5, other), "trained for another model"),
             (LoRARequest("big", 1, dirs[2]), "above max_lora_rank 8"),
             (LoRARequest("dora", 2, dora), "DoRA"),
             (LoRARequest("missing", 3, str(tmp_path / "nowhere")), "no adapter_config.json"),
             (LoRARequest("a0", 4, dirs[0]), None)]
    for request, message in cases:
        if message is None:
            assert lora_greedy(llm, PROMPTS[:1], [request], 4)  # the engine still serves
            continue
        with pytest.raises(ValueError, match=message):
            lora_greedy(llm, PROMPTS[:1], [request], 4)
    with pytest.raises(ValueError, match="lora_int_id 4 is adapter"):
        lora_greedy(llm, PROMPTS[:1], [LoRARequest("a1", 4, dirs[1])], 4)
    llm.shutdown()
    with pytest.raises(ValueError, match="quantized model"):
        LLM(model=base, device="cpu", enable_lora=True, quantization="int8", **tiny_engine_options())
    plain = LLM(model=base, device="cpu", **tiny_engine_options())
    with pytest.raises(ValueError, match="enable_lora=True"):
        lora_greedy(plain, PROMPTS[:1], [LoRARequest("a0", 1, dirs[0])], 4)
    plain.shutdown()


def test_a_worker_reads_adapters_ahead_on_its_own_thread_once(checkpoints, adapter_dirs, monkeypatch):
    """An adapter the scheduler asks to read ahead is read on the store's thread, once; its
    write takes that read; a read that failed leaves its slot empty, comes back as a failure
    naming the adapter, and is forgotten, so the next write reads again."""
    from tpu_executor.core.step import LoRAFailure
    from tpu_executor.worker import lora_loader

    reads = []

    def recorded(path):
        reads.append((path, threading.current_thread().name))
        if len(reads) == 2:
            raise OSError("disk gone")
        return real(path)

    real, (first, second) = lora_loader.read_adapter, adapter_dirs["llama"][:2]
    monkeypatch.setattr(lora_loader, "read_adapter", recorded)
    llm = LLM(model=checkpoints["llama"], device="cpu", enable_lora=True, max_loras=2, **tiny_engine_options())
    store = llm.engine.core.executor.workers[0].adapters
    store.read_ahead([LoRARequest("a", 1, first), LoRARequest("b", 2, second)])
    assert store.write([(1, LoRARequest("a", 1, first))]) == []
    assert store.write([(2, LoRARequest("b", 2, second))]) == [
        LoRAFailure(2, 2, "LoRA adapter 'b' could not be loaded: disk gone")]
    layers = lora_loader.lora_layers(store.model)
    assert all(not layer.lora_a[2].any() and not layer.lora_b[2].any() for layer in layers)
    assert store.write([(2, LoRARequest("b", 2, second)), (1, LoRARequest("a", 1, first))]) == []
    assert [path for path, _ in reads] == [first, second, second]
    assert [thread.startswith("lora-read") for _, thread in reads] == [True, True, False]
    llm.shutdown()


@pytest.mark.slow  # XLA compilation
@pytest.mark.parametrize("device", ["xla", "jax"])
def test_compiled_paths_equal_the_native_path_and_compile_nothing_after_warmup(checkpoints, adapter_dirs, device):
    """Four adapters and the base over two slots on torch_xla and JAX: the native path's
    tokens, and no compilation after warm-up (strict) while adapters are written into slots."""
    base, dirs = checkpoints["llama"], adapter_dirs["llama"]
    requests = [None] + [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(dirs)]
    prompts = [p for p in PROMPTS for _ in requests]
    adapters = [r for _ in PROMPTS for r in requests]
    native = LLM(model=base, device="cpu", enable_lora=True, max_loras=2, **tiny_engine_options())
    expected = lora_greedy(native, prompts, adapters, NEW_TOKENS)
    native.shutdown()
    llm = LLM(model=base, device=device, enable_lora=True, max_loras=2, **tiny_engine_options(strict=True))
    assert lora_greedy(llm, prompts, adapters, NEW_TOKENS) == expected
    assert llm.stats().graphs_compiled_after_warmup == 0
    llm.shutdown()


@pytest.mark.slow  # XLA compilation
def test_200_random_requests_over_more_adapters_than_slots_compile_nothing(checkpoints, tmp_path):
    """200 random requests (every sampling feature) spread over six adapters and the base, two
    slots: the JAX path equals the native path and compiles nothing after warm-up (strict)."""
    base = checkpoints["llama"]
    adapters = [LoRARequest(f"r{i}", i + 1, write_random_lora_adapter(base, str(tmp_path / f"r{i}"), rank=4 + 2 * i,
                                                                      seed=10 + i)) for i in range(6)]
    per_request = [None if i % 7 == 0 else adapters[(i * 5) % 6] for i in range(200)]
    native = LLM(model=base, device="cpu", enable_lora=True, max_loras=2, **tiny_engine_options())
    compiled = LLM(model=base, device="jax", enable_lora=True, max_loras=2, **tiny_engine_options(strict=True))
    try:
        assert_same_outputs_over_random_requests(native, compiled, lora_requests=per_request)
        assert compiled.stats().graphs_compiled_after_warmup == 0
    finally:
        native.shutdown()
        compiled.shutdown()


SPMD_RUN = textwrap.dedent("""
    import json, sys
    from tests.common import assert_same_outputs_over_random_requests, mixed_prompts, tiny_engine_options
    from tpu_executor import LLM, LoRARequest, SamplingParams
    base, adapters = sys.argv[1], json.loads(sys.argv[2])
    requests = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = mixed_prompts(3, 8, 40, vocab=500, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    result = {}
    for tp in (1, 2):
        llm = LLM(model=base, device="jax", tensor_parallel_size=tp, enable_lora=True, max_loras=2,
                  **tiny_engine_options(strict=True))
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in requests], params, use_tqdm=False,
                               lora_request=[r for _ in prompts for r in requests])
        result[tp] = dict(tokens=[o.outputs[0].token_ids for o in outputs],
                          after=llm.stats().graphs_compiled_after_warmup)
        llm.shutdown()
    print(json.dumps(result))
""")


@pytest.mark.slow  # XLA compilation, in a fresh interpreter with two virtual devices
def test_jax_spmd_at_tp2_equals_one_device(checkpoints, adapter_dirs):
    """JAX SPMD over two virtual CPU devices (adapter slots split with their layers): the
    tokens of one device, nothing compiled after warm-up."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", SPMD_RUN, checkpoints["llama"], json.dumps(adapter_dirs["llama"])],
                            env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs["2"]["tokens"] == runs["1"]["tokens"]
    assert runs["1"]["after"] == runs["2"]["after"] == 0
