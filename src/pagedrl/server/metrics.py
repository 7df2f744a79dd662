"""Prometheus metrics under vLLM's names with the prefix `pagedrl:`: a vLLM dashboard reads them once its
`vllm:` prefix is replaced, and the series it shows that are not here stay empty.

Two sources: engine counters and gauges are read from `AsyncEngine.metrics_snapshot()` at scrape time (one source
of truth, nothing to keep in sync), and per-request latencies are observed when a request ends, from
the timings its stream recorded on the event loop (what a client sees, queueing included).
"""

from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedrl.engine.async_engine import AsyncEngine
from pagedrl.engine.request_stream import RequestStream

PREFIX = "pagedrl:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# vLLM's buckets, so histograms from both servers can be compared bucket by bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's `build_1_2_5_buckets`: its token-count histograms')."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class EngineCollector:
    """Gauges and counters the engine already counts, read when Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric(self.labels, value)
        return c

    def collect(self):
        s = self.engine.metrics_snapshot()
        yield self._gauge("num_requests_running", "Number of requests in model execution batches.",
                          s.num_requests_running)
        yield self._gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                          s.num_requests_waiting)
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage_perc)
        yield self._gauge("num_blocks_used", "KV-cache blocks held by live requests.", s.num_blocks_used)
        yield self._gauge("num_blocks_total", "KV-cache blocks in total.", s.num_blocks_total)
        yield self._gauge("model_weight_bytes", "Bytes the model's weights hold in memory (GGUF blocks where kept "
                          "quantized).", s.weight_bytes)
        yield self._counter("prefix_cache_queries", "Prefix cache queries, in number of queried tokens.",
                            s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prefix cache hits, in number of queried tokens.", s.prefix_cache_hits)
        yield self._counter("num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions)
        yield self._counter("prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter("generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        if s.lora is not None:  # vLLM's info gauge: the adapters in the labels, the time as the value
            info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on lora requests.",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(s.lora.running), ",".join(s.lora.waiting), str(s.lora.max_loras)], time.time())
            yield info


class ServerMetrics:
    """The registry `/metrics` renders; subscribes to the engine's end-of-request events."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        prometheus_client.disable_created_metrics()  # vLLM exposes no *_created series either
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(engine, model_name))
        self.request_success = Counter(PREFIX + "request_success", "Count of finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Histogram of end to end request latency "
                             "in seconds.", ["model_name"], buckets=E2E_BUCKETS,
                             registry=self.registry).labels(model_name)
        tokens = one_two_five_buckets(engine.max_model_len)
        self.prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Number of prefill tokens processed.",
                                       ["model_name"], buckets=tokens, registry=self.registry).labels(model_name)
        self.generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Number of generation tokens "
                                           "processed.", ["model_name"], buckets=tokens,
                                           registry=self.registry).labels(model_name)
        self.params_n = Histogram(PREFIX + "request_params_n", "Histogram of the n request parameter.",
                                  ["model_name"], buckets=N_BUCKETS, registry=self.registry).labels(model_name)
        self.per_output_token = Histogram(
            PREFIX + "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per "
            "request.", ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        engine.listeners.append(self.on_request_end)

    def on_request_end(self, stream: RequestStream) -> None:
        reason = stream.finish_reason or "abort"
        self.request_success.labels(self.model_name, reason).inc()
        if stream.first_token_time is not None:
            self.ttft.observe(stream.first_token_time - stream.arrival)
        for gap in stream.inter_token_latencies:
            self.itl.observe(gap)
        if stream.finish_time is not None:
            self.e2e.observe(stream.finish_time - stream.arrival)
        self.prompt_tokens.observe(len(stream.prompt_token_ids))
        self.generation_tokens.observe(stream.num_generation_tokens)
        self.params_n.observe(stream.num_seqs)
        if stream.inter_token_latencies:  # decode time over the tokens after the first, as vLLM's
            self.per_output_token.observe((stream.last_token_time - stream.first_token_time)
                                          / len(stream.inter_token_latencies))

    def render(self) -> bytes:
        return generate_latest(self.registry)
