"""Prometheus metrics of one server, in its own registry (several servers can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

    def bind(self, stats) -> None:
        """stats() -> the engine's latest stats dict; the gauges read it at scrape time."""
        self.waiting.set_function(lambda: stats()["waiting"])
        self.running.set_function(lambda: stats()["running"])
        self.kv_usage.set_function(lambda: stats()["kv_usage"])
        self.hit_rate.set_function(lambda: stats()["prefix_hit_rate"])
        self.preemptions.set_function(lambda: stats()["preemptions"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
