"""Prometheus metrics of one server, in its own registry (several servers can live in one process).

Beside engc's own, the gauges that load-aware gateways scrape, under the names they read: the Kubernetes
Gateway API Inference Extension's endpoint picker reads a model server's queue length and KV-cache
utilization as vLLM names them (its model server protocol: `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, and `vllm:gpu_cache_usage_perc` in its older releases), its running requests
as `vllm:num_requests_running`, and the block size and cache size from the labels of
`vllm:cache_config_info` (prefix-aware scheduling). Like vLLM's, they carry the served model's name."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# (name, help, engine stats key); "perc" is vLLM's name for a fraction from 0 to 1
GATEWAY_GAUGES = (("vllm:num_requests_waiting", "Requests waiting for a place in the batch", "waiting"),
                  ("vllm:num_requests_running", "Requests in the running batch", "running"),
                  ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1)", "kv_usage"),
                  ("vllm:gpu_cache_usage_perc", "Fraction of KV blocks in use (0 to 1; the older name)", "kv_usage"))
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("engc_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("engc_prompt_tokens", "Prompt tokens of finished sequences", registry=r)
        self.cached_tokens = Counter("engc_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("engc_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("engc_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("engc_time_per_output_token_seconds", "Latency between output tokens", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("engc_request_latency_seconds", "Whole-request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.waiting = Gauge("engc_num_requests_waiting", "Sequences queued for admission", registry=r)
        self.running = Gauge("engc_num_requests_running", "Sequences in the running batch", registry=r)
        self.kv_usage = Gauge("engc_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.hit_rate = Gauge("engc_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / all",
                              registry=r)
        self.preemptions = Gauge("engc_num_preemptions", "Sequences preempted so far", registry=r)
        self.gateway = {name: (Gauge(name, doc, ["model_name"], registry=r), key) for name, doc, key in GATEWAY_GAUGES}
        self.cache_config = Gauge("vllm:cache_config_info", "KV cache configuration (labels; value 1)",
                                  ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=r)

    def bind(self, stats) -> None:
        """stats() -> the engine's latest stats dict; the gauges read it at scrape time."""
        self.waiting.set_function(lambda: stats()["waiting"])
        self.running.set_function(lambda: stats()["running"])
        self.kv_usage.set_function(lambda: stats()["kv_usage"])
        self.hit_rate.set_function(lambda: stats()["prefix_hit_rate"])
        self.preemptions.set_function(lambda: stats()["preemptions"])

    def bind_gateway(self, stats, model_name: str, block_size: int, prefix_cache: bool) -> None:
        """The inference gateway's gauges (module docstring) over the same stats, labelled with the served
        model's name."""
        for gauge, key in self.gateway.values():
            gauge.labels(model_name=model_name).set_function(lambda key=key: stats()[key])
        self.cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(stats()["num_blocks"]),
                                 enable_prefix_caching=str(prefix_cache)).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
