"""Every Prometheus metric of the gateway, on a registry of its own; labels are bounded by config."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# LLM latencies span milliseconds (ITL) to minutes (long generations).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class PoolCollector(Collector):
    """Reads backend health, breaker, in-flight and scraped engine load at scrape time (no per-request cost)."""

    def __init__(self, backends: Callable[[], Iterable]) -> None:
        self._backends = backends

    def collect(self):
        now = time.monotonic()
        health = GaugeMetricFamily("shapegate_backend_health", "1 for the backend's current health state",
                                   labels=["backend", "engine", "state"])
        breaker = GaugeMetricFamily("shapegate_backend_breaker", "1 for the backend's current breaker state",
                                    labels=["backend", "engine", "state"])
        in_flight = GaugeMetricFamily("shapegate_in_flight", "Requests in flight per backend",
                                      labels=["backend", "engine"])
        running = GaugeMetricFamily("shapegate_engine_running", "Engine-reported running requests",
                                    labels=["backend", "engine"])
        waiting = GaugeMetricFamily("shapegate_engine_waiting", "Engine-reported queued requests",
                                    labels=["backend", "engine"])
        kv = GaugeMetricFamily("shapegate_engine_kv_usage", "Engine-reported KV cache usage (0-1)",
                               labels=["backend", "engine"])
        for b in self._backends():
            for s in ("starting", "ready", "unhealthy", "draining"):
                health.add_metric([b.id, b.engine, s], 1.0 if b.health.state == s else 0.0)
            bs = b.breaker.state(now)
            for s in ("closed", "open", "half_open"):
                breaker.add_metric([b.id, b.engine, s], 1.0 if bs == s else 0.0)
            in_flight.add_metric([b.id, b.engine], b.in_flight)
            load = b.fresh_load(now)
            if load is not None:
                for fam, v in ((running, load.running), (waiting, load.waiting), (kv, load.kv_usage)):
                    if v is not None:
                        fam.add_metric([b.id, b.engine], v)
        yield from (health, breaker, in_flight, running, waiting, kv)


class Metrics:
    """The gateway's metrics; children are cached per label set so the hot path skips label lookups."""

    def __init__(self, backends: Callable[[], Iterable]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("shapegate_requests", "Requests answered, by backend and status",
                                ["backend", "model", "class", "status"], registry=r)
        self.ttft = Histogram("shapegate_ttft_seconds", "Time to first token measured by the gateway",
                              ["backend", "class"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("shapegate_itl_seconds", "Inter-token latency measured by the gateway",
                             ["backend", "class"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("shapegate_e2e_seconds", "End-to-end request latency",
                             ["backend", "class"], buckets=E2E_BUCKETS, registry=r)
        self.overhead = Histogram("shapegate_gateway_overhead_seconds",
                                  "Time spent in the gateway itself before the upstream call",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.prompt_tokens = Counter("shapegate_prompt_tokens", "Prompt tokens", ["backend"], registry=r)
        self.completion_tokens = Counter("shapegate_completion_tokens", "Completion tokens", ["backend"],
                                         registry=r)
        self.decisions = Counter("shapegate_routing_decisions", "Routing decisions by policy and reason",
                                 ["policy", "backend", "reason"], registry=r)
        self.retries = Counter("shapegate_upstream_retries", "Failovers to another backend", ["backend"],
                               registry=r)
        self.client_errors = Counter("shapegate_upstream_client_errors", "4xx answers relayed from engines",
                                     ["backend", "status"], registry=r)
        self.rejected = Counter("shapegate_rejected", "Requests refused by the gateway itself", ["status"],
                                registry=r)
        r.register(PoolCollector(backends))
        self._children: dict[tuple, tuple] = {}

    def observe(self, backend: str, model: str, klass: str, status: int, ttft: float | None,
                itl: float | None, e2e: float, prompt: int, completion: int, overhead: float) -> None:
        key = (backend, model, klass, status)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = (
                self.requests.labels(backend, model, klass, str(status)), self.ttft.labels(backend, klass),
                self.itl.labels(backend, klass), self.e2e.labels(backend, klass),
                self.prompt_tokens.labels(backend), self.completion_tokens.labels(backend))
        req, h_ttft, h_itl, h_e2e, c_prompt, c_completion = c
        req.inc()
        if ttft is not None:
            h_ttft.observe(ttft)
        if itl is not None:
            h_itl.observe(itl)
        h_e2e.observe(e2e)
        if prompt:
            c_prompt.inc(prompt)
        if completion:
            c_completion.inc(completion)
        self.overhead.observe(overhead)

    def decision(self, policy: str, backend: str, reason: str) -> None:
        self.decisions.labels(policy, backend, reason).inc()

    def retry(self, backend: str) -> None:
        self.retries.labels(backend).inc()

    def client_error(self, backend: str, status: int) -> None:
        self.client_errors.labels(backend, str(status)).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
