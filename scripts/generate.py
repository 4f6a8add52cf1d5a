"""Offline generation: prints completions for a few prompts (default model: SmolLM2-135M-Instruct).

    python -m scripts.generate                       # default model, XLA (TPU or CPU backend)
    python -m scripts.generate --device cpu          # the native eager path
    python -m scripts.generate --model DIR --prompt "Hello" --temperature 0.7 --top-p 0.9
    python -m scripts.generate --tensor-parallel-size 4   # one Ray actor per TPU chip
    python -m scripts.generate --quantization int8       # INT8 weight-only

Across TPU hosts, start through ``scripts.launch`` (it joins the Ray cluster and checks it).
"""
from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a compiler does.",
    "List three primary colors.",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: SmolLM2, prepared once)")
    parser.add_argument("--device", default="xla", choices=["xla", "cpu"])
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four examples")
    parser.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--prefill-buckets", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--decode-buckets", type=int, nargs="+", default=[4])
    parser.add_argument("--decode-context-buckets", type=int, nargs="+", default=[256])
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="chips (Ray workers) to shard over")
    parser.add_argument("--ray-address", default=None, help="Ray cluster to run the workers on (default: local)")
    parser.add_argument("--quantization", choices=["int8"], default=None, help="INT8 weight-only linears and experts")
    return parser.parse_args(argv)


def format_prompts(tokenizer, prompts, use_chat_template: bool):
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return prompts
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def main(argv=None) -> None:
    args = parse_args(argv)
    from scripts.prepare_default_model import prepare
    from tpu_executor import LLM, SamplingParams

    model = args.model or prepare()
    start = time.perf_counter()
    llm = LLM(model=model, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, prefill_buckets=tuple(args.prefill_buckets),
              decode_buckets=tuple(args.decode_buckets),
              decode_context_buckets=tuple(args.decode_context_buckets),
              tensor_parallel_size=args.tensor_parallel_size, ray_address=args.ray_address,
              quantization=args.quantization)
    print(f"engine ready in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.stats.compilations} XLA compilations, {llm.engine.stats.num_blocks} KV blocks)")
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(format_prompts(llm.get_tokenizer(), prompts, not args.no_chat_template), params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{output.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s); "
          f"recompilations after warm-up: {llm.engine.compilations_since_warmup()}")
    llm.shutdown()


if __name__ == "__main__":
    main()
