"""``tpu-executor generate``: offline generation for a few prompts, printed with timings.

    tpu-executor generate                              # default model (SmolLM2), XLA
    tpu-executor generate --device cpu                 # the native eager path (cuda: on a GPU)
    tpu-executor generate DIR --prompt "Hello" --temperature 0.7 --top-p 0.9
    tpu-executor generate --tensor-parallel-size 4     # one Ray actor per TPU chip
    tpu-executor generate --quantization int8          # INT8 weight-only
"""
from __future__ import annotations

import argparse
import time

from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a compiler does.",
    "List three primary colors.",
]
# A few short prompts need little, and every bucket is a graph compiled at start-up.
ENGINE_DEFAULTS = dict(max_model_len=256, max_num_seqs=4, prefill_buckets=(128, 256), decode_buckets=(4,),
                       decode_context_buckets=(256,))
WHY_DEFAULTS = ("Defaults here are sized for a few short prompts (every bucket is a graph compiled at start-up): "
                "max_model_len, max_num_seqs and the three bucket lists differ from the engine's.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="generate completions for a few prompts",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("model", nargs="?", help="Hugging Face checkpoint directory (default: SmolLM2-135M-"
                                                 "Instruct, converted once into ~/.cache/tpu_executor)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four examples")
    parser.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    add_engine_arguments(parser, defaults=ENGINE_DEFAULTS, why=WHY_DEFAULTS)
    parser.set_defaults(run=run)
    return parser


def format_prompts(tokenizer, prompts, use_chat_template: bool):
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return prompts
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def run(args: argparse.Namespace) -> None:
    from tpu_executor.core.sampling_params import SamplingParams
    from tpu_executor.engine.stats import startup_report
    from tpu_executor.entrypoints.llm import LLM
    from tpu_executor.tools.default_model import prepare

    start = time.perf_counter()
    llm = LLM(args.model or prepare(), **engine_options_from_args(args))
    print(startup_report(llm.engine.config, llm.stats(), time.perf_counter() - start), flush=True)
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(format_prompts(llm.get_tokenizer(), prompts, not args.no_chat_template), params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{output.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s); "
          f"recompilations after warm-up: {llm.stats().graphs_compiled_after_warmup}")
    llm.shutdown()
