"""Every Prometheus metric of the gateway, on a registry of its own; labels are bounded by config."""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Final, Iterable, Iterator, Literal, Sequence

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.contracts import OK, REJECTED
from gateway.observe.lean_metrics import LeanCollector, LeanCounter, LeanCounterChild, LeanFiles, LeanHistogram
from gateway.observe.queue_metrics import QueueMetrics

# LLM latencies span milliseconds (ITL) to minutes (long generations).
TTFT_BUCKETS: Final = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
ITL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1)
E2E_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
LOOP_LAG_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
OVERHEAD_BUCKETS: Final = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
HEALTH_STATES: Final = ("starting", "ready", "unhealthy", "draining")
BREAKER_STATES: Final = ("closed", "open", "half_open")
# A policy's reason is free text; its first word is kept as a label, up to this many distinct ones.
MAX_REASON_KINDS: Final = 32
MAX_CACHED_REASONS: Final = 4096

# name, help, labels, multiprocess mode. Modes, when several worker processes each hold their own view:
# in-flight adds up over live workers; a health/breaker state reads 1 when any live worker sees the backend
# in it; engine load is the engine's own number, so the freshest sample any worker took wins, and the
# sample age is the youngest one.
GaugeMode = Literal["livemax", "livesum", "livemostrecent", "livemin"]
POOL_GAUGES: tuple[tuple[str, str, tuple[str, ...], GaugeMode], ...] = (
    ("shapegate_backend_health", "1 for the backend's current health state", ("backend", "engine", "state"),
     "livemax"),
    ("shapegate_backend_breaker", "1 for the backend's current breaker state", ("backend", "engine", "state"),
     "livemax"),
    ("shapegate_in_flight", "Requests in flight per backend", ("backend", "engine"), "livesum"),
    ("shapegate_engine_running", "Engine-reported running requests", ("backend", "engine"), "livemostrecent"),
    ("shapegate_engine_waiting", "Engine-reported queued requests", ("backend", "engine"), "livemostrecent"),
    ("shapegate_engine_kv_usage", "Engine-reported KV cache usage (0-1)", ("backend", "engine"), "livemostrecent"),
    ("shapegate_engine_load_age_seconds", "Age of the last engine load sample (stale ones are not used for "
     "routing)", ("backend", "engine"), "livemin"),
    ("shapegate_engine_reported_ttft_seconds", "The engine's own mean TTFT over recent scrapes of its metrics",
     ("backend", "engine"), "livemostrecent"),
    ("shapegate_engine_reported_itl_seconds", "The engine's own mean inter-token latency over recent scrapes",
     ("backend", "engine"), "livemostrecent"),
    ("shapegate_latency_fit_divergence", "The gateway's fitted ITL at the engine's current load over the engine's "
     "own mean ITL (1: they agree)", ("backend", "engine"), "livemostrecent"),
)


def reason_kind(policy: str, reason: str) -> str:
    """'shape:long_output itl=4ms vs 9ms' -> 'long_output': the first word, without the policy's own prefix."""
    head = reason.split(" ", 1)[0]
    name, sep, rest = head.partition(":")
    if sep and name == policy:
        head = rest
    return head.rstrip(";,") or "none"


def pool_samples(backends: Iterable, now: float) -> Iterator[tuple[str, tuple[str, ...], float | None]]:
    """(metric, label values, value) for every pool gauge; None where the engine's load sample is stale."""
    for b in backends:
        bid, engine = b.id, b.engine
        for s in HEALTH_STATES:
            yield "shapegate_backend_health", (bid, engine, s), 1.0 if b.health.state == s else 0.0
        bs = b.breaker.state(now)
        for s in BREAKER_STATES:
            yield "shapegate_backend_breaker", (bid, engine, s), 1.0 if bs == s else 0.0
        yield "shapegate_in_flight", (bid, engine), float(b.in_flight)
        if b.load is not None:
            yield "shapegate_engine_load_age_seconds", (bid, engine), max(now - b.load.at, 0.0)
        load = b.fresh_load(now)
        r = b.reported
        if r.ttft is not None:
            yield "shapegate_engine_reported_ttft_seconds", (bid, engine), r.ttft
        if r.itl is not None:
            yield "shapegate_engine_reported_itl_seconds", (bid, engine), r.itl
            running = load.running if load is not None and load.running else 1.0
            yield "shapegate_latency_fit_divergence", (bid, engine), b.latency.estimate().itl(running) / r.itl
        for name, v in (("shapegate_engine_running", load.running if load else None),
                        ("shapegate_engine_waiting", load.waiting if load else None),
                        ("shapegate_engine_kv_usage", load.kv_usage if load else None)):
            yield name, (bid, engine), v


class PoolCollector(Collector):
    """One process: reads health, breaker, in-flight and engine load at scrape time (no per-request cost)."""

    def __init__(self, backends: Callable[[], Iterable]) -> None:
        self._backends = backends

    def collect(self):
        fams = {name: GaugeMetricFamily(name, doc, labels=list(labels)) for name, doc, labels, _ in POOL_GAUGES}
        for name, labels, v in pool_samples(self._backends(), time.monotonic()):
            if v is not None:
                fams[name].add_metric(list(labels), v)
        yield from fams.values()


class PoolGauges:
    """Several processes: each worker writes its pool view into shared gauges, on a timer and before a scrape."""

    def __init__(self, backends: Callable[[], Iterable], registry: CollectorRegistry) -> None:
        self._backends = backends
        self._gauges = {name: Gauge(name, doc, labels, registry=registry, multiprocess_mode=mode)
                        for name, doc, labels, mode in POOL_GAUGES}
        self._children: dict[tuple[str, tuple[str, ...]], object] = {}
        self._seen: set[tuple[str, tuple[str, ...]]] = set()

    def refresh(self) -> None:
        seen = set()
        for name, labels, v in pool_samples(self._backends(), time.monotonic()):
            key = (name, labels)
            seen.add(key)
            self._child(key).set(math.nan if v is None else v)
        # A backend a reload removed keeps its series in this worker's file: zero it rather than leave it lit.
        for key in self._seen - seen:
            self._child(key).set(math.nan if key[0].startswith("shapegate_engine_") else 0.0)
        self._seen = seen

    def _child(self, key):
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self._gauges[key[0]].labels(*key[1])
        return c


class Metrics:
    """The gateway's metrics; children are cached per label set so the hot path skips label lookups.

    With PROMETHEUS_MULTIPROC_DIR set (`shapegate serve --workers N`), each worker still counts in memory and
    copies its values into that directory every 0.2 s (LeanFiles, PoolGauges); a scrape of any worker merges them.
    """

    def __init__(self, backends: Callable[[], Iterable], key_ids: Callable[[], Iterable[str]] = tuple) -> None:
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        r = self.registry = CollectorRegistry()
        lean: list[LeanHistogram | LeanCounter] = []

        def histogram(name: str, doc: str, labels: list[str], buckets: tuple) -> LeanHistogram:
            h = LeanHistogram(name, doc, labels, buckets)
            lean.append(h)
            return h

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> LeanCounter:
            c = LeanCounter(name, doc, labels)
            lean.append(c)
            return c

        # One per attempt on a backend, and one per request the gateway refused before trying any (backend "",
        # outcome "rejected"); outcome is one of gateway.contracts.RESULTS.
        self.requests = counter("shapegate_requests", "Attempts by backend, status and outcome, and refused "
                                "requests, by the API route (chat, responses, messages, ...)", ["backend", "model", "class", "status", "outcome",
                                                                  "route"])
        self.ttft = histogram("shapegate_ttft_seconds", "Time to first token measured by the gateway",
                              ["backend", "class"], TTFT_BUCKETS)
        self.itl = histogram("shapegate_itl_seconds", "Inter-token latency measured by the gateway",
                             ["backend", "class"], ITL_BUCKETS)
        self.e2e = histogram("shapegate_e2e_seconds", "End-to-end request latency", ["backend", "class"], E2E_BUCKETS)
        self.overhead = histogram("shapegate_gateway_overhead_seconds",
                                  "Time spent in the gateway itself before the upstream call", [], OVERHEAD_BUCKETS)
        self._overhead = self.overhead.labels()
        self.prompt_tokens = counter("shapegate_prompt_tokens", "Prompt tokens", ["backend"])
        self.completion_tokens = counter("shapegate_completion_tokens", "Completion tokens", ["backend"])
        self.decisions = counter("shapegate_routing_decisions", "Routing decisions by policy, first choice "
                                 "and reason kind", ["policy", "backend", "reason"])
        self.affinity_lookups = counter("shapegate_prefix_affinity", "Prefix/session affinity lookups",
                                        ["result"])
        self.retries = counter("shapegate_upstream_retries", "Failovers to another backend", ["backend"])
        self.breaker_openings = counter("shapegate_breaker_openings", "Times a backend's circuit breaker opened",
                                        ["backend"])
        self.client_errors = counter("shapegate_upstream_client_errors", "4xx answers relayed from engines",
                                     ["backend", "status"])
        self.rejected = counter("shapegate_rejected", "Requests refused by the gateway itself", ["status"])
        self.stream_errors = counter("shapegate_stream_errors",
                                     "Streams ended with an error event after output had started", ["backend"])
        self.health_changes = counter("shapegate_backend_health_changes", "Probe-driven health state changes",
                                      ["backend", "state"])
        self.reloads = counter("shapegate_config_reloads", "Configuration reloads by result", ["result"])
        # Experiments: label values come from the configuration only (experiment, arm names) and the classes.
        self.exp_requests = counter("shapegate_experiment_requests", "Attempts of requests under an experiment, "
                                    "by arm and outcome", ["experiment", "arm", "class", "outcome"])
        self.exp_ttft = histogram("shapegate_experiment_ttft_seconds", "Time to first token per experiment arm",
                                  ["experiment", "arm", "class"], TTFT_BUCKETS)
        self.exp_itl = histogram("shapegate_experiment_itl_seconds", "Inter-token latency per experiment arm",
                                 ["experiment", "arm", "class"], ITL_BUCKETS)
        self.exp_e2e = histogram("shapegate_experiment_e2e_seconds", "End-to-end latency per experiment arm",
                                 ["experiment", "arm", "class"], E2E_BUCKETS)
        self.shadow_copies = counter("shapegate_shadow_requests", "Shadow copies by arm and result (sent, ok, "
                                     "engine_error, client_error, skipped_busy, skipped_unhealthy)",
                                     ["experiment", "arm", "result"])
        self.shadow_agreement = counter("shapegate_shadow_agreement", "Temperature-0 shadow copies whose output "
                                        "matched the primary's exactly (same) or not (differs)",
                                        ["experiment", "arm", "output"])
        self.log_dropped = counter("shapegate_access_log_dropped", "Access log lines dropped because stdout "
                                   "did not keep up")
        # Rate limits: labels are the two kinds and three reasons, never a key.
        self.limit_refusals = counter("shapegate_ratelimit_refused", "Requests refused by a key's rate limit, by "
                                      "the kind of limit that ran out (requests, tokens, quota: a token quota per day "
                                      "or month)", ["kind"])
        self.limit_local_decisions = counter("shapegate_ratelimit_local_decisions", "Rate-limit checks this process "
                                             "decided on its own share of the limit because the shared Redis buckets "
                                             "did not answer (timeout, error), were known down (unavailable) or had "
                                             "lost their buckets in a restart (restarted)",
                                             ["reason"])
        self._limit_refused = {k: self.limit_refusals.labels(k) for k in ("requests", "tokens", "quota")}
        self._limit_local = {r: self.limit_local_decisions.labels(r) for r in ("timeout", "error", "unavailable",
                                                                                    "restarted")}
        # Replicas sharing Redis (gateway/ops/replica_sync.py): what came in from the others, and failed rounds.
        self.replica_imports = counter("shapegate_replica_imports", "Taken from other replicas: requests their "
                                       "latency models learned from (latency), breaker openings (breaker), "
                                       "backends whose learned seat counts grew (seats)", ["kind"])
        self.replica_sync_errors = counter("shapegate_replica_sync_errors", "Rounds of sharing latency learning, "
                                           "breaker openings and seat counts that Redis failed")
        # The event loop's own health (gateway/observe/loop_watch.py): how late its timers fire, GC pauses.
        self.loop_lag = histogram("shapegate_event_loop_lag_seconds", "How late a 50 ms timer of the event loop "
                                  "fired (work or a pause that held the loop)", [], LOOP_LAG_BUCKETS)
        self.gc_pause = histogram("shapegate_gc_pause_seconds", "Garbage collections, by the oldest generation "
                                  "collected", ["generation"], LOOP_LAG_BUCKETS)
        self.queue = QueueMetrics(histogram, counter, r, key_ids)
        Gauge("shapegate_workers", "Gateway worker processes serving", registry=r,
              multiprocess_mode="livesum").set(1)
        if self.multiprocess_dir:
            self._pool: PoolGauges | None = PoolGauges(backends, r)
            self._files: LeanFiles | None = LeanFiles(lean)
        else:
            self._pool, self._files = None, None
            r.register(PoolCollector(backends))
            r.register(LeanCollector(lean))
        self._children: dict[tuple, tuple] = {}
        self._decisions: dict[tuple[str, str, str], LeanCounterChild] = {}
        self._by_reason: dict[tuple[str, str, str], LeanCounterChild] = {}
        self._kinds: set[str] = set()
        self._kind_of: dict[tuple[str, str], str] = {}
        self.failovers: dict[str, int] = {}  # per backend since start, for /stats (folded into its windows)
        self._affinity = (self.affinity_lookups.labels("miss"), self.affinity_lookups.labels("hit"))

    def _request_children(self, backend: str, model: str, klass: str, status: int, result: str,
                          route: str) -> tuple:
        key = (backend, model, klass, status, result, route)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = (
                self.requests.labels(backend, model, klass, str(status), result, route), self.ttft.labels(backend, klass),
                self.itl.labels(backend, klass), self.e2e.labels(backend, klass),
                self.prompt_tokens.labels(backend), self.completion_tokens.labels(backend))
        return c

    def observe(self, backend: str, model: str, klass: str, status: int, ttft: float | None,
                itl: float | None, e2e: float, prompt: int, completion: int, overhead: float,
                result: str = OK, route: str = "chat") -> None:
        req, h_ttft, h_itl, h_e2e, c_prompt, c_completion = self._request_children(backend, model, klass, status,
                                                                                   result, route)
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
        self._overhead.observe(overhead)

    def count(self, backend: str, model: str, klass: str, status: int, prompt: int, completion: int,
              result: str = OK, route: str = "chat") -> None:
        """observe() without the histograms: what stays on when stats upkeep is switched off."""
        req, _, _, _, c_prompt, c_completion = self._request_children(backend, model, klass, status, result, route)
        req.inc()
        if prompt:
            c_prompt.inc(prompt)
        if completion:
            c_completion.inc(completion)

    def decision(self, policy: str, backend: str, reason: str) -> None:
        # Reasons repeat (a policy has few of them, numbers aside): the child is found by the whole reason.
        c = self._by_reason.get((policy, backend, reason))
        if c is None:
            c = self._decision_child(policy, backend, reason)
            if len(self._by_reason) < MAX_CACHED_REASONS:
                self._by_reason[(policy, backend, reason)] = c
        c.inc()

    def reason_kind(self, policy: str, reason: str) -> str:
        """The reason's first word as the `reason` label has it: at most MAX_REASON_KINDS kinds, then "other"."""
        kind = self._kind_of.get((policy, reason))
        if kind is not None:
            return kind
        kind = reason_kind(policy, reason)
        if kind not in self._kinds:
            if len(self._kinds) >= MAX_REASON_KINDS:
                kind = "other"  # a policy that puts numbers in its first word must not explode the series
            else:
                self._kinds.add(kind)
        if len(self._kind_of) < MAX_CACHED_REASONS:
            self._kind_of[(policy, reason)] = kind
        return kind

    def _decision_child(self, policy: str, backend: str, reason: str) -> LeanCounterChild:
        kind = self.reason_kind(policy, reason)
        key = (policy, backend, kind)
        c = self._decisions.get(key)
        if c is None:
            c = self._decisions[key] = self.decisions.labels(policy, backend, kind)
        return c

    def affinity(self, hit: bool) -> None:
        self._affinity[hit].inc()

    def retry(self, backend: str) -> None:
        self.retries.labels(backend).inc()
        self.failovers[backend] = self.failovers.get(backend, 0) + 1

    def breaker_opened(self, backend: str, times: int) -> None:
        self.breaker_openings.labels(backend).inc(times)

    def client_error(self, backend: str, status: int) -> None:
        self.client_errors.labels(backend, str(status)).inc()

    def stream_error(self, backend: str) -> None:
        self.stream_errors.labels(backend).inc()

    def health_change(self, backend: str, state: str) -> None:
        self.health_changes.labels(backend, state).inc()

    def reload(self, result: str) -> None:
        self.reloads.labels(result).inc()

    def reject(self, status: int) -> None:
        """A request the front refused before it reached the gateway's pipeline (malformed, too large, too slow)."""
        self.rejected.labels(str(status)).inc()

    def refuse(self, status: int, model: str, klass: str, route: str = "chat") -> None:
        """A request refused before any backend was tried (admission, no backend, rate limit): `model` is a
        served model or "" (never a client's free text), `klass` a request class or "", `route` an API route's
        name (the server's table: never a client's text)."""
        self.rejected.labels(str(status)).inc()
        self.requests.labels("", model, klass, str(status), REJECTED, route).inc()

    def experiment(self, name: str, arm: str, klass: str, o) -> None:
        self.exp_requests.labels(name, arm, klass, o.result).inc()
        if o.result == OK:
            if o.ttft is not None:
                self.exp_ttft.labels(name, arm, klass).observe(o.ttft)
            if o.itl is not None:
                self.exp_itl.labels(name, arm, klass).observe(o.itl)
            self.exp_e2e.labels(name, arm, klass).observe(o.e2e)

    def shadow(self, name: str, arm: str, result: str) -> None:
        self.shadow_copies.labels(name, arm, result).inc()

    def agreement(self, name: str, arm: str, same: bool) -> None:
        self.shadow_agreement.labels(name, arm, "same" if same else "differs").inc()

    def limit_refused(self, kind: str) -> None:
        self._limit_refused[kind].inc()

    def limit_local(self, reason: str) -> None:
        self._limit_local[reason].inc()

    def log_drop(self, lines: int) -> None:
        self.log_dropped.inc(lines)

    def replica_import(self, kind: str, n: int) -> None:
        self.replica_imports.labels(kind).inc(n)

    def queue_end(self, priority: str, outcome: str, waited: float) -> None:
        self.queue.ended(priority, outcome, waited)

    def queue_changed(self, queue) -> None:
        self.queue.changed(queue)

    def replica_sync_error(self) -> None:
        self.replica_sync_errors.inc()

    def refresh(self) -> None:
        """Write this worker's values and pool view for the other workers' scrapes (a no-op in one process)."""
        if self._files is not None:
            self._files.flush()
        if self._pool is not None:
            self._pool.refresh()

    def exposition(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.refresh()
        # Reads every worker's small value files (page cache, once per scrape) and merges them.
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self.multiprocess_dir)
        return generate_latest(merged)
