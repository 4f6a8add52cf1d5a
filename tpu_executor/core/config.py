"""Frozen engine configuration, validated once at construction.

Every config is a frozen dataclass whose ``__post_init__`` checks its own fields and raises a
``ValueError`` that names the field and says what to change. ``EngineConfig`` checks the
relations between them (e.g. buckets versus the model's context length).
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from tpu_executor.core.speculative import SpeculativeConfig

# "xla": compiled graphs through torch_xla; any other torch device runs the native eager path.
DEVICE_PATTERN = re.compile(r"^(xla|jax|cpu|cuda(:\d+)?)$")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4", "w8a8")
# Reasoning formats (a ``<think>`` ... ``</think>`` block before the answer), as vLLM names them.
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def tpu_attached() -> bool:
    """Whether this machine has TPU chips (their device files; nothing is started)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def checkpoint_dtype(path: str) -> Optional[str]:
    """The dtype a checkpoint's config.json names for its weights (its text model's, for a
    multimodal one), or None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(section.get(key), str):
                return section[key]
    return None


def resolve_dtype(requested: str, checkpoint: Optional[str], platform: str) -> str:
    """``dtype="auto"`` made concrete: bf16 on a TPU (for bf16, fp16 and fp32 checkpoints
    alike: its MXU runs bf16, and fp32 weights would take twice the HBM); the checkpoint's half
    type on a GPU (bf16 for an fp32 one), as vLLM does; fp32 on the CPU paths, where bf16 is
    slower. Any other value is kept."""
    if requested != "auto":
        return requested
    if platform == "tpu":
        return "bfloat16"
    if platform == "cuda":
        return checkpoint if checkpoint in ("bfloat16", "float16") else "bfloat16"
    return "float32"


def device_platform(device: str) -> str:
    """The chips a device setting runs on here: tpu, cuda or cpu."""
    if device in ("xla", "jax"):
        return "tpu" if tpu_attached() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def option(default=None, help: str = "", default_factory=None, none_means: str = ""):
    """A config field that is also an engine option (``LLM`` keyword, command-line flag);
    ``none_means`` says what a ``None`` default stands for (``--help`` shows it)."""
    metadata = {"help": help, "none_means": none_means}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _sorted_positive(name: str, values: Tuple[int, ...]) -> Tuple[int, ...]:
    values = tuple(int(v) for v in values)
    _require(len(values) > 0, f"{name} must list at least one bucket")
    _require(all(v > 0 for v in values), f"{name} must be positive integers, got {values}")
    _require(len(set(values)) == len(values), f"{name} has duplicate buckets: {values}")
    return tuple(sorted(values))


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how.

    ``model`` is a directory in Hugging Face layout (config.json, *.safetensors, tokenizer).
    ``max_model_len`` caps prompt + output tokens; ``None`` takes the checkpoint's context
    length, lowered at start-up to what the KV cache holds (``fit_max_model_len``).
    ``quantization="int8"`` stores the linear and expert weights as INT8 with one scale per
    output channel, ``"int4"`` as INT4 with one scale per group of 128 inputs (or 64, 32, 16
    where 128 does not divide half a layer's inputs), both quantized at load time (weight-only:
    activations stay in ``dtype``); ``"w8a8"`` stores INT8 weights as ``int8`` does and also
    quantizes the linears' activations to INT8 per token, so the matmul runs in INT8 (experts
    stay weight-only). A checkpoint published quantized (its config's ``quantization_config``:
    compressed-tensors, GPTQ, AWQ) loads in its own scheme and takes no ``quantization``.
    ``reasoning_parser`` names the checkpoint's reasoning format (``REASONING_PARSERS``): a
    request's grammar (structured outputs, tool calls) then constrains only the answer after
    the reasoning, as vLLM's ``StructuredOutputsConfig.reasoning_parser`` does, and the server
    splits the reasoning out as ``reasoning_content``.
    """

    model: str
    dtype: str = option("auto", f"weights and activations, one of {DTYPES}; auto: bfloat16 on a TPU, the "
                                "checkpoint's half type on a GPU, float32 on a CPU")
    max_model_len: Optional[int] = option(None, "prompt + output tokens per sequence", none_means=(
        "the checkpoint's context length, lowered to what the KV cache holds"))
    seed: int = option(0, "seed of the engine (draws the seeds of unseeded requests)")
    quantization: Optional[str] = option(None, "int8: weight-only INT8 linears and experts (W8A16); int4: "
                                               "INT4 in groups of 128 inputs (W4A16); w8a8: INT8 weights and "
                                               "per-token INT8 activations in the linears")
    reasoning_parser: Optional[str] = option(
        None, f"the model's reasoning format, {' or '.join(REASONING_PARSERS)}: grammars apply after its "
              "</think>, and the server returns its <think> block as reasoning_content")

    def __post_init__(self):
        _require(isinstance(self.model, str) and self.model != "", "model must be a checkpoint path")
        _require(os.path.isdir(self.model),
                 f"model path {self.model!r} is not a directory; pass a Hugging Face checkpoint "
                 "directory (`tpu-executor generate` prepares the default one)")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be positive, got {self.max_model_len}")
        _require(self.quantization in (None,) + QUANTIZATIONS,
                 f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(self.reasoning_parser in (None,) + REASONING_PARSERS,
                 f"reasoning_parser must be None or one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how much memory it may take.

    On CPU the cache is sized from ``memory_budget_bytes`` (after the weights); on TPU and
    GPU from the device's memory times ``memory_utilization`` after a profiling run.
    ``num_blocks`` fixes the count outright (tests use it to make preemption happen).
    """

    block_size: int = option(16, "tokens per KV-cache block: 8, 16, 32, 64 or 128")
    memory_utilization: float = option(0.9, "fraction of TPU/GPU memory the engine may use")
    memory_budget_bytes: int = option(2 << 30, "CPU: bytes for weights + KV cache")
    num_blocks: Optional[int] = option(None, "KV-cache blocks", none_means="as many as fit")
    enable_prefix_caching: bool = option(True, "share full KV blocks between equal prompt prefixes")

    def __post_init__(self):
        _require(self.block_size in (8, 16, 32, 64, 128),
                 f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _require(0.0 < self.memory_utilization <= 1.0,
                 f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        _require(self.memory_budget_bytes > 0, "memory_budget_bytes must be positive")
        _require(self.num_blocks is None or self.num_blocks >= 2,
                 f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = option(64, "sequences running at once (the largest decode batch)")
    max_num_batched_tokens: int = option(2048, "tokens computed in one step (the token budget)")
    enable_chunked_prefill: bool = option(True, "split prompts longer than the token budget into chunks "
                                                "(decodes go first each step; prefill buckets stop at the budget)")
    async_scheduling: Optional[bool] = option(
        None, "schedule and prepare step N+1 while step N runs (identical outputs; a finished request may "
              "compute one discarded token)",
        none_means="on for xla, jax and cuda, off for cpu")
    core_process: bool = option(False, "run the engine core (scheduling, the executor, recording tokens) in a "
                                       "process of its own, beside the front-end's text, stop strings and deltas")

    def __post_init__(self):
        _require(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens > 0,
                 f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        # Decodes take the budget first: with every other sequence decoding, a prompt still
        # needs a token of it to move on.
        _require(not self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens {self.max_num_batched_tokens} is below max_num_seqs "
                 f"{self.max_num_seqs}: with chunked prefill the decodes alone could fill every step")


@dataclass(frozen=True)
class CompileConfig:
    """The requested buckets and the compile cache (``core/buckets.py`` turns the buckets into
    the plan the runner compiles).

    ``prefill_buckets`` are token counts of one prefill call, which packs up to
    ``max_prefill_seqs`` prompts (their cached + new tokens); ``decode_buckets`` are decode
    batch sizes (sequences); ``decode_context_buckets`` are token widths of a decode batch's
    longest context (the attention reads that many cache slots per sequence); ``bucket_config``
    names the file they were read from, if any (``engine/options.py``). ``strict`` makes
    any compilation after warm-up an error. ``cache_dir`` holds the persistent compile cache
    (``None`` disables it). ``compile_threads``: the JAX path compiles that many graphs at once.
    """

    prefill_buckets: Tuple[int, ...] = option((64, 128, 256, 512, 1024, 2048),
                                              "prefill buckets, in tokens of one packed call")
    decode_buckets: Tuple[int, ...] = option((8, 16, 32, 64), "decode buckets, in sequences")
    decode_context_buckets: Tuple[int, ...] = option((512, 2048), "decode context buckets, in tokens")
    strict: bool = option(False, "raise on any compilation after warm-up")
    strict_kernels: bool = option(False, "on a TPU, a Pallas kernel that refuses a bucket's shapes is an error "
                                         "(else a warning naming the op, the shapes and the reason)")
    cache_dir: Optional[str] = option(
        default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", "xla"),
        help="persistent compile cache (torch_xla: TPU only; the jax path: every platform)")
    compile_threads: int = option(0, "graphs the jax path compiles at once at start-up (0: one per host core; "
                                     "one on a TPU, whose compiler crashes compiling two at once)")
    max_logprobs: int = option(20, "largest logprobs a request may ask for")
    max_prefill_seqs: int = option(8, "prompts packed into one prefill call")
    bucket_config: Optional[str] = option(None, "bucket file from `tpu-executor tune`: sets the three "
                                                "bucket lists and the limits they were tuned for")

    def __post_init__(self):
        object.__setattr__(self, "prefill_buckets", _sorted_positive("prefill_buckets", self.prefill_buckets))
        object.__setattr__(self, "decode_buckets", _sorted_positive("decode_buckets", self.decode_buckets))
        object.__setattr__(self, "decode_context_buckets",
                           _sorted_positive("decode_context_buckets", self.decode_context_buckets))
        _require(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        _require(isinstance(self.compile_threads, int) and self.compile_threads >= 0,
                 f"compile_threads must be an integer >= 0, got {self.compile_threads!r}")
        _require(self.max_prefill_seqs >= 1, f"max_prefill_seqs must be >= 1, got {self.max_prefill_seqs}")


@dataclass(frozen=True)
class DeviceConfig:
    """``"xla"`` runs compiled graphs through torch_xla (TPU, or XLA's CPU backend); ``"jax"``
    traces the same model through torchax and compiles it with ``jax.jit`` (a persistent
    compile cache that loads, SPMD tensor parallelism); a torch device (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``) runs the native eager path there."""

    device: str = option("xla", "xla (torch_xla: TPU or XLA's CPU backend), jax (torchax + jax.jit), "
                                "or a torch device for the native eager path: cpu, cuda, cuda:N")

    def __post_init__(self):
        _require(isinstance(self.device, str) and DEVICE_PATTERN.match(self.device) is not None,
                 f"device must be 'xla', 'jax', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _require(self.device != "xla" or importlib.util.find_spec("torch_xla") is not None,
                 "device 'xla' needs torch_xla, which installs on x86-64 Linux only (pip install "
                 "torch_xla==2.9.0); elsewhere use device 'jax' or a torch device such as 'cpu'")

    @property
    def is_xla(self) -> bool:
        return self.device == "xla"

    @property
    def is_jax(self) -> bool:
        return self.device == "jax"

    @property
    def compiles(self) -> bool:
        """Whether the path compiles graphs per bucket (XLA and JAX) or runs eagerly."""
        return self.device in ("xla", "jax")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` workers (one per TPU chip), each an actor
    of the Ray cluster at ``ray_address`` (``None``: the cluster this process is connected to,
    else a local one). Above 1 the engine runs the Ray executor; 1 runs in-process unless a
    Ray address is given. ``collective_timeout_s`` bounds how long a rank waits for the others
    in a CPU (gloo) collective, so a lost peer cannot hang the rest forever;
    ``step_timeout_s`` is how long a step may take before its workers count as unresponsive."""

    tensor_parallel_size: int = option(1, "chips (workers) to shard the model over")
    ray_address: Optional[str] = option(None, "Ray cluster for the workers ('auto': this host's)")
    collective_timeout_s: float = option(60.0, "seconds a rank waits in a CPU collective")
    step_timeout_s: float = option(600.0, "seconds a Ray worker may take for one call")

    def __post_init__(self):
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        _require(self.collective_timeout_s > 0,
                 f"collective_timeout_s must be positive, got {self.collective_timeout_s}")
        _require(self.step_timeout_s > 0, f"step_timeout_s must be positive, got {self.step_timeout_s}")

    @property
    def uses_ray(self) -> bool:
        return self.tensor_parallel_size > 1 or self.ray_address is not None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (vLLM's options): PEFT LoRA adapters served over the base model, up to
    ``max_loras`` different ones in a step (a device slot each, slot 0 being the base model),
    each of rank at most ``max_lora_rank``; the host keeps ``max_cpu_loras`` of them read."""

    enable_lora: bool = option(False, "serve LoRA adapters (a request names one: LoRARequest, or the "
                                      "server's model field)")
    max_loras: int = option(1, "different adapters in one step (device slots)")
    max_lora_rank: int = option(16, "the largest adapter rank served")
    max_cpu_loras: Optional[int] = option(None, "adapters kept read on the host", none_means="max_loras")

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _require(not isinstance(value, bool) and isinstance(value, int) and value >= 1,
                     f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _require(not isinstance(self.max_cpu_loras, bool) and isinstance(self.max_cpu_loras, int)
                 and self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")

    @property
    def num_slots(self) -> int:
        """Device slots per layer: one per adapter of a step, and slot 0 (zeros) for the base."""
        return self.max_loras + 1


@dataclass(frozen=True)
class EngineConfig:
    """All configs together, with the cross-checks between them.

    ``max_model_len`` here is resolved (never ``None``); see ``resolve_max_model_len``.
    """

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compile: CompileConfig
    device: DeviceConfig
    max_model_len: int
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: Optional[SpeculativeConfig] = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        if self.model.dtype == "auto":
            dtype = resolve_dtype("auto", checkpoint_dtype(self.model.model), device_platform(self.device.device))
            object.__setattr__(self, "model", replace(self.model, dtype=dtype))
        if self.scheduler.async_scheduling is None:
            # On the native CPU path the host is the device: there is nothing to overlap, and a
            # prompt arriving mid-step would wait behind the step already scheduled. N-gram
            # drafts are made from the accepted tokens, so each step waits for the one before.
            overlap = self.device.device != "cpu" and self.speculative is None
            object.__setattr__(self, "scheduler", replace(self.scheduler, async_scheduling=overlap))
        _require(self.speculative is None or not self.scheduler.async_scheduling,
                 "async_scheduling cannot be on with speculative decoding: the drafters need each "
                 "step's accepted tokens before the next step (leave async_scheduling unset)")
        _require(not (self.lora.enable_lora and self.model.quantization is not None),
                 f"enable_lora cannot serve adapters over a {self.model.quantization}-quantized model: "
                 "leave quantization unset to serve LoRA adapters")
        block = self.cache.block_size
        bad = [b for b in self.compile.prefill_buckets if b % block]
        _require(not bad, f"prefill_buckets {bad} are not multiples of block_size {block}")
        bad = [b for b in self.compile.decode_context_buckets if b % block]
        _require(not bad, f"decode_context_buckets {bad} are not multiples of block_size {block}")
        _require(self.scheduler.enable_chunked_prefill or self.scheduler.max_num_batched_tokens >= self.max_model_len,
                 f"max_num_batched_tokens {self.scheduler.max_num_batched_tokens} is below "
                 f"max_model_len {self.max_model_len}: a full-length prompt could never run "
                 "(enable chunked prefill, or raise max_num_batched_tokens)")

    @property
    def uses_ray(self) -> bool:
        """Workers in Ray actors: tensor parallelism over chips with a worker each, or a named
        cluster. The JAX path shards over one host's chips from one process (SPMD); given a
        Ray cluster it runs one such process per host (multi-host)."""
        if self.device.is_jax:
            return self.parallel.ray_address is not None
        return self.parallel.uses_ray

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.cache.block_size)


# The sections whose fields are engine options, in the order the command line lists them.
OPTION_SECTIONS = (ModelConfig, DeviceConfig, CacheConfig, SchedulerConfig, CompileConfig, ParallelConfig,
                   LoRAConfig)


def resolve_max_model_len(checkpoint_limit: int, user_limit: Optional[int], scheduler: SchedulerConfig) -> int:
    """The longest context the engine may serve: the user's value, else the checkpoint's
    limit (without chunked prefill, also the token budget: a prompt must fit one step). The
    engine core may lower a default one to what the KV cache holds (``fit_max_model_len``)."""
    if user_limit is None:
        if scheduler.enable_chunked_prefill:
            return checkpoint_limit
        return min(checkpoint_limit, scheduler.max_num_batched_tokens)
    _require(user_limit <= checkpoint_limit,
             f"max_model_len {user_limit} exceeds the checkpoint's context length {checkpoint_limit}")
    return user_limit


def fit_max_model_len(config: EngineConfig, num_blocks: int) -> EngineConfig:
    """``config`` with a default ``max_model_len`` lowered to the tokens ``num_blocks`` KV
    blocks hold (block 0 is the null block). A ``max_model_len`` the user set is kept: the
    worker has already refused a cache too small for it."""
    block = config.cache.block_size
    held = (num_blocks - 1) * block
    if config.model.max_model_len is not None or held >= config.max_model_len:
        return config
    _require(held >= block, f"the KV cache holds {num_blocks} blocks, no room for a sequence; raise "
                            "memory_budget_bytes / memory_utilization")
    return replace(config, max_model_len=held)
