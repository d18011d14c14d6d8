"""Prometheus text exposition of a simulated engine, with that engine's own metric names and labels."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.sim.scheduler import Scheduler
from gateway.sim.telemetry import Histogram, Telemetry

Labels = dict[str, str]


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels | None) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}"


class Exposition:
    """Builds the text format: HELP and TYPE once per family, then its samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str,
               samples: Iterable[tuple[str, Labels | None, float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for sample, labels, value in samples:
            self.lines.append(f"{sample}{_labels(labels)} {float(value)!r}")

    def gauge(self, name: str, help_: str, value: float, labels: Labels | None = None) -> None:
        self.family(name, "gauge", help_, [(name, labels, value)])

    def counter(self, name: str, help_: str, value: float, labels: Labels | None = None) -> None:
        self.family(name, "counter", help_, [(name, labels, value)])

    def histogram(self, name: str, help_: str, hist: Histogram, labels: Labels) -> None:
        samples: list[tuple[str, Labels | None, float]] = [
            (f"{name}_bucket", {**labels, "le": le}, n) for le, n in hist.cumulative()
        ]
        samples.append((f"{name}_count", labels, hist.count))
        samples.append((f"{name}_sum", labels, hist.sum))
        self.family(name, "histogram", help_, samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(engine: str, model: str, sched: Scheduler, tel: Telemetry, now: float) -> str:
    """The /metrics body for one engine flavour."""
    out = Exposition()
    if engine == "vllm":
        _vllm(out, model, sched, tel, now)
    elif engine == "sglang":
        _sglang(out, model, sched, tel, now)
    else:
        _llamacpp(out, sched, tel)
    return out.text()


def _vllm(out: Exposition, model: str, sched: Scheduler, tel: Telemetry, now: float) -> None:
    lab = {"engine": "0", "model_name": model}
    c = sched.counters
    kv = sched.kv_used_tokens() / sched.profile.kv_tokens
    out.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              len(sched.running), lab)
    out.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              sched.waiting_count(now), lab)
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv, lab)
    out.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
               [("vllm:cache_config_info",
                 {**lab, "block_size": "16", "enable_prefix_caching": "True"}, 1.0)])
    out.counter("vllm:num_preemptions_total", "Cumulative number of preemptions.", 0, lab)
    out.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                c.prompt_tokens, lab)
    out.counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                c.generation_tokens, lab)
    out.counter("vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.", c.prompt_tokens, lab)
    out.counter("vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.", c.cached_tokens, lab)
    reasons = {"stop": 0, "length": 0, "abort": c.aborted, **c.by_reason}
    out.family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               [("vllm:request_success_total", {**lab, "finished_reason": r}, n)
                for r, n in sorted(reasons.items())])
    out.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                  tel.ttft, lab)
    out.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                  tel.itl, lab)
    out.histogram("vllm:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", tel.tpot, lab)
    out.histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", tel.e2e, lab)
    out.histogram("vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", tel.queue, lab)


def _sglang(out: Exposition, model: str, sched: Scheduler, tel: Telemetry, now: float) -> None:
    lab = {"model_name": model}
    c = sched.counters
    used = sched.kv_used_tokens()
    out.gauge("sglang:num_running_reqs", "The number of running requests.", len(sched.running), lab)
    out.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
              sched.waiting_count(now), lab)
    out.gauge("sglang:num_used_tokens", "The number of used tokens.", used, lab)
    out.gauge("sglang:token_usage", "The token usage.", used / sched.profile.kv_tokens, lab)
    out.gauge("sglang:gen_throughput", "The generation throughput (token/s).", tel.gen_throughput,
              lab)
    out.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", c.last_hit_rate, lab)
    out.gauge("sglang:num_retracted_reqs", "The number of retracted requests.", 0, lab)
    out.gauge("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.",
              0, lab)
    out.counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                c.prompt_tokens, lab)
    out.counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                c.generation_tokens, lab)
    out.counter("sglang:cached_tokens_total", "Number of cached prompt tokens.", c.cached_tokens, lab)
    out.counter("sglang:num_requests_total", "Number of requests processed.", tel.requests_total, lab)
    out.counter("sglang:num_aborted_requests_total", "Number of requests aborted.", c.aborted, lab)
    out.histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                  tel.ttft, lab)
    out.histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                  tel.itl, lab)
    out.histogram("sglang:e2e_request_latency_seconds",
                  "Histogram of End-to-end request latency in seconds", tel.e2e, lab)
    out.histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", tel.queue, lab)


def _llamacpp(out: Exposition, sched: Scheduler, tel: Telemetry) -> None:
    c = sched.counters
    bucket = tel.take_bucket()
    busy = sum(1 for owner in sched.slot_owner if owner is not None)
    out.counter("llamacpp:prompt_tokens_total", "Number of prompt tokens processed.",
                c.prompt_tokens - c.cached_tokens)
    out.counter("llamacpp:prompt_seconds_total", "Prompt process time", tel.prompt_seconds)
    out.counter("llamacpp:tokens_predicted_total", "Number of generation tokens processed.",
                tel.predicted_tokens)
    out.counter("llamacpp:tokens_predicted_seconds_total", "Predict process time",
                tel.predicted_seconds)
    out.counter("llamacpp:prompt_tokens_cached_total", "Number of prompt tokens reused from cache.",
                c.cached_tokens)
    out.counter("llamacpp:n_decode_total", "Total number of llama_decode() calls", c.steps)
    out.counter("llamacpp:n_tokens_max", "Largest observed n_tokens.", tel.n_tokens_max)
    for what in ("draft_tokens", "accepted_tokens", "drafts"):  # no draft model: always 0
        out.counter(f"llamacpp:spec_decode_num_{what}_total", f"Speculative decoding: {what}.", 0)
    out.gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
              bucket.prompt_tokens / bucket.prompt_ms * 1000.0 if bucket.prompt_ms else 0.0)
    out.gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
              bucket.predicted_tokens / bucket.predicted_ms * 1000.0 if bucket.predicted_ms else 0.0)
    out.gauge("llamacpp:requests_processing", "Number of requests processing.", busy)
    out.gauge("llamacpp:requests_deferred", "Number of requests deferred.", len(sched.waiting))
    # a gauge in build 11434, although it averages over every decode call since start
    out.gauge("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
              c.seq_steps / c.steps if c.steps else 0.0)
