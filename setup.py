"""tpu_executor: TPU-first LLM inference on PyTorch/XLA (CPU XLA for development)."""
from setuptools import find_packages, setup

MAPPED_FOLDERS = {"models": "tpu_executor.models", "pallas_kernels": "tpu_executor.kernels"}
# Ops with a C kernel for the native CPU path: compiled from source on the machine that runs it.
C_KERNEL_OPS = ("act_and_mul", "packed_matmul", "paged_attention", "rms_norm", "rotary_embedding", "write_kv_cache")


def mapped_packages():
    """The packages under each mapped folder, named under their installed prefix."""
    return [prefixed + name[len(folder):] for folder, prefixed in MAPPED_FOLDERS.items()
            for name in [folder] + [f"{folder}.{sub}" for sub in find_packages(folder)]]

setup(
    name="tpu_executor",
    version="0.1.0",
    description="TPU-first LLM inference backend on PyTorch/XLA with paged KV cache and bucketed compilation",
    python_requires=">=3.10,<3.13",
    # The repository's top-level models/ and pallas_kernels/ install as tpu_executor.models and
    # tpu_executor.kernels: import names of the project's own, which a user's models/ folder
    # beside a script cannot shadow.
    packages=find_packages(include=["tpu_executor*"]) + mapped_packages(),
    package_dir={prefixed: folder for folder, prefixed in MAPPED_FOLDERS.items()},
    package_data={"tpu_executor.kernels": ["*.h"], **{f"tpu_executor.kernels.{op}": ["*.c"] for op in C_KERNEL_OPS}},
    install_requires=[
        # torch_xla 2.9 is the last release; it needs exactly torch 2.9.0. Its wheels are x86-64
        # Linux only: elsewhere the package installs for the JAX and native paths, and device
        # "xla" says what is missing. Its core is installed without its `pallas`/`tpu` extras,
        # whose jax 0.7.1 and libtpu 0.0.21 pins cannot describe a v7x (docs/tpu.md).
        "torch==2.9.0",
        "torch_xla==2.9.0; platform_machine == 'x86_64' and sys_platform == 'linux'",
        "jax==0.10.2",
        "jaxlib==0.10.2",
        # call_jax (JAX kernels inside torch_xla graphs) goes through torchax, which imports flax.
        "torchax==0.0.13",
        "flax==0.12.8",
        # The JAX path keeps its traced programs (jax.export's serialization needs flatbuffers).
        "flatbuffers>=24.3",
        # Ray runs the per-chip workers; its Serve library runs the replicas behind one endpoint.
        "ray[serve]>=2.50,<3",
        "transformers>=5.0,<6",
        "safetensors>=0.5",
        "tokenizers>=0.21",
        "tqdm>=4.66",
        "numpy>=1.26",
        # The default model ships as GGUF: transformers needs gguf (and accelerate) to read it.
        "gguf>=0.10",
        "accelerate>=1.0",
        # The OpenAI-compatible server, its metrics, and the serving benchmark's HTTP client.
        "fastapi>=0.115",
        "uvicorn>=0.30",
        "prometheus_client>=0.20",
        "httpx>=0.27",
        # Structured outputs: grammars compiled to per-step token masks; schemas checked first.
        "xgrammar>=0.2.8,<0.3",
        "jsonschema>=4.0",
        # `tpu-executor tune` draws its padding/warm-up plot.
        "matplotlib>=3.8",
    ],
    extras_require={
        # The tests compile for TPU slices with libtpu, the TPU's compiler (it runs without a
        # TPU): the very version jax[tpu]==0.10.2 pins, so the compiler matches jaxlib's XLA.
        # ruff is pinned: CI runs `ruff check` before the tests, and its rules move between versions.
        # peft is the oracle the LoRA tests compare with (transformers + peft, fp32);
        # compressed-tensors writes the quantized test checkpoints transformers reads back (its
        # later releases require a newer torch than the 2.9.0 pinned here).
        "test": ["pytest>=8", "hypothesis>=6.100", "openai>=1.40", "libtpu==0.0.42.1", "ruff==0.17.6", "peft==0.21.2",
                 "compressed-tensors==0.15.0.1"],
        # On a TPU VM, and to compile for one (`tpu-executor compile`): jax's own libtpu.
        "tpu": ["libtpu==0.0.42.1"],
    },
    entry_points={"console_scripts": ["tpu-executor = tpu_executor.cli:main"]},
)
