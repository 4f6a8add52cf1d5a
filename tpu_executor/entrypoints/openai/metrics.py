"""Prometheus metrics of the server, named like vLLM's with the prefix ``tpu_executor:``.

Two sources: the engine's own figures (``EngineStats``: running and waiting requests, KV-cache
usage, preemptions, prefix-cache queries and hits, compiled graphs, speculative decoding's
drafts and accepted tokens), read fresh at every
scrape; and per-request timings the server observes as outputs come out (time to first
token, inter-token latency, time per output token, end-to-end latency, queue time, token
counts, finish reasons, requests by sampling feature, grammar compile times). The time to
first token is the engine's for every request (when the step that made the token was read
back, ``RequestMetrics``): a request that does not stream
gets one output at its end (it asks the engine for ``FINAL_ONLY``, as in vLLM). Such a request
adds to the time per output token but not to the inter-token latency, which is the gap
between two deltas of a streamed request.
Each server has a registry of its own, so several servers in one process do not collide.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tpu_executor.core.request import RequestOutput
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.stats import EngineStats

PREFIX = "tpu_executor:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


class EngineStatsCollector:
    """Exposes the last ``EngineStats`` snapshot of each engine (set before each scrape), by
    engine name: a lone engine's (``""``) series have no label, replicas' a ``replica`` label."""

    GAUGES = {
        "num_requests_running": ("Sequences running on the engine.", lambda s: s.num_running),
        "num_requests_waiting": ("Sequences waiting to be scheduled.", lambda s: s.num_waiting),
        "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (0-1).", lambda s: s.kv_cache_usage),
        "compiled_graphs": ("Graphs compiled at warm-up.", lambda s: s.graphs_compiled_at_warmup),
        "compilations_after_warmup": ("Graphs compiled after warm-up (must stay 0).",
                                      lambda s: s.graphs_compiled_after_warmup),
        "lora_slots_in_use": ("LoRA adapter slots that running requests use.", lambda s: s.lora_slots_in_use),
    }
    COUNTERS = {
        "num_preemptions": ("Preemptions (by recompute).", lambda s: s.num_preemptions),
        "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
        "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
        "spec_decode_num_drafts": ("Verifies of draft tokens (speculative decoding).",
                                   lambda s: s.spec_decode.num_drafts),
        "spec_decode_num_draft_tokens": ("Draft tokens verified.", lambda s: s.spec_decode.num_draft_tokens),
        "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", lambda s: s.spec_decode.num_accepted_tokens),
    }

    def __init__(self):
        self.stats_by_engine: Mapping[str, EngineStats] = {"": EngineStats()}

    def collect(self) -> Iterator[Metric]:
        labelled = any(self.stats_by_engine)
        for kinds, family_class in ((self.GAUGES, GaugeMetricFamily), (self.COUNTERS, CounterMetricFamily)):
            for name, (doc, value_of) in kinds.items():
                family = family_class(PREFIX + name, doc, labels=["replica"] if labelled else [])
                for engine, stats in sorted(self.stats_by_engine.items()):
                    family.add_metric([engine] if labelled else [], value_of(stats))
                yield family
        yield self._accepted_per_position(labelled)

    def _accepted_per_position(self, labelled: bool) -> Metric:
        """Accepted draft tokens by their position in the draft (vLLM's ``position`` label)."""
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=(["replica"] if labelled else []) + ["position"])
        for engine, stats in sorted(self.stats_by_engine.items()):
            for position, count in enumerate(stats.spec_decode.accepted_per_position):
                family.add_metric(([engine] if labelled else []) + [str(position)], count)
        return family


class ServerMetrics:
    """The server's Prometheus registry and the per-request observations."""

    def __init__(self, collectors: Iterable[Any] = ()):
        disable_created_metrics()  # no ``*_created`` series beside every counter (vLLM does the same)
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector()
        for collector in (self.engine_stats, *collectors):
            self.registry.register(collector)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests admitted.",
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                                       ["finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Seconds from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Seconds between two deltas of a streamed request.")
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Seconds per output token after the first, per request (its longest sample).")
        self.e2e = histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Seconds from arrival to first scheduling.")
        self.requests_by_feature = Counter(PREFIX + "requests_by_feature",
                                           "Requests admitted that use a sampling feature, by feature.", ["feature"],
                                           registry=self.registry)
        self.grammar_compile = histogram("grammar_compile_seconds",
                                         "Seconds to compile a request's grammar (cached ones are not compiled).")
        self.lora_requests = Counter(PREFIX + "lora_requests", "Requests admitted that run a LoRA adapter, by adapter.",
                                     ["lora_name"], registry=self.registry)
        self.lora_generation_tokens = Counter(PREFIX + "lora_generation_tokens",
                                              "Tokens generated with a LoRA adapter, by adapter.", ["lora_name"],
                                              registry=self.registry)

    def render(self, stats_by_engine: Mapping[str, EngineStats]) -> bytes:
        """The text exposition, with each engine's figures (``EngineClient.stats_by_engine``)."""
        self.engine_stats.stats_by_engine = stats_by_engine
        return generate_latest(self.registry)

    def tracker(self, num_prompt_tokens: int, arrival_time: float, params: SamplingParams,
                features: Sequence[str] = (), lora_name: Optional[str] = None) -> "RequestTracker":
        """Observations of one engine request, fed each delta as it goes out; ``features`` are
        what it uses beyond ``params`` (tools); ``lora_name`` its adapter's served name."""
        self.prompt_tokens.inc(num_prompt_tokens)
        for feature in (*features_of(params), *features):
            self.requests_by_feature.labels(feature).inc()
        if lora_name is not None:
            self.lora_requests.labels(lora_name).inc()
        return RequestTracker(self, arrival_time, lora_name)


def features_of(params: SamplingParams) -> List[str]:
    """The sampling features a request uses (the ``feature`` label of ``requests_by_feature``)."""
    used = {"structured_outputs": params.structured_outputs is not None,
            "penalties": bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0),
            "logit_bias": bool(params.logit_bias), "min_tokens": params.min_tokens > 0,
            "allowed_token_ids": params.allowed_token_ids is not None, "bad_words": bool(params.bad_words),
            "logprobs": params.logprobs is not None, "prompt_logprobs": params.prompt_logprobs is not None}
    return [feature for feature, on in used.items() if on]


class RequestTracker:
    """Times one request's deltas into the server's histograms and counters."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float, lora_name: Optional[str] = None):
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.lora_name = lora_name
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.sample_tokens: Dict[int, int] = {}  # tokens so far, by sample index

    def observe(self, delta: RequestOutput) -> None:
        m, now = self.metrics, time.monotonic()
        new_tokens = 0
        for completion in delta.outputs:
            count = len(completion.token_ids)
            new_tokens += count
            self.sample_tokens[completion.index] = self.sample_tokens.get(completion.index, 0) + count
            if completion.finish_reason is not None:
                m.request_success.labels(completion.finish_reason).inc()
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if self.lora_name is not None:
                m.lora_generation_tokens.labels(self.lora_name).inc(new_tokens)
            if self.last_token_time is None:
                # The engine's time when it has one: a final-only output comes at the end.
                engine_time = delta.metrics.first_token_time if delta.metrics is not None else None
                self.first_token_time = engine_time if engine_time is not None else now
                m.ttft.observe(self.first_token_time - self.arrival_time)
            else:
                m.itl.observe(now - self.last_token_time)
            self.last_token_time = now
        if delta.finished:
            self._observe_finished(delta, now)

    def _observe_finished(self, delta: RequestOutput, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - self.arrival_time)
        if delta.metrics is not None and delta.metrics.queue_time is not None:
            m.queue_time.observe(delta.metrics.queue_time)
        longest = max(self.sample_tokens.values(), default=0)
        if longest > 1 and self.first_token_time is not None:
            m.tpot.observe((now - self.first_token_time) / (longest - 1))
