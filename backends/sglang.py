"""SGLang adapter: /health runs a one-token generation (503 while starting); load from sglang: gauges or /v1/loads."""

from __future__ import annotations

import time

import orjson

from backends.openai_http import OpenAIHTTPBackend, load_from_gauges, parse_gauges
from gateway.apis.registry import ENGINE_APIS
from gateway.contracts import LoadSample


class SGLangBackend(OpenAIHTTPBackend):
    engine = "sglang"
    apis = ENGINE_APIS - {"responses_input_tokens", "translations"}
    health_path = "/health"
    liveness_path = "/ping"  # always 200 once the server is up, even while starting: liveness, not readiness
    deep_probe_generates = True  # /health runs a one-token generation
    metrics_path = "/metrics"
    loads_path = "/v1/loads"
    legacy_load_path = "/get_load"
    metric_names = {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        # The engine's own TTFT and per-token inter-token histograms (older builds: time_per_output_token).
        "ttft_sum": ("sglang:time_to_first_token_seconds_sum",),
        "ttft_count": ("sglang:time_to_first_token_seconds_count",),
        "itl_sum": ("sglang:inter_token_latency_seconds_sum", "sglang:time_per_output_token_seconds_sum"),
        "itl_count": ("sglang:inter_token_latency_seconds_count", "sglang:time_per_output_token_seconds_count"),
    }

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        # /metrics exists only with --enable-metrics; once it is found missing, scrape the JSON load route.
        self._metrics_off = False

    async def sample_load(self, timeout: float) -> LoadSample | None:
        if not self._metrics_off:
            status, body = await self._get(self.metrics_path, timeout)
            if status == 200:
                return load_from_gauges(parse_gauges(body.decode("utf-8", "replace"), self.metric_names),
                                        time.monotonic())
            if status not in (404, 501):
                return None  # a passing error: try /metrics again next time
            self._metrics_off = True
        status, body = await self._get(self.loads_path, timeout)
        if status == 200:
            return loads_sample(orjson.loads(body), time.monotonic())
        status, body = await self._get(self.legacy_load_path, timeout)
        return legacy_load_sample(orjson.loads(body), time.monotonic()) if status == 200 else None


def _ranks(data) -> list[dict]:
    if isinstance(data, dict):
        data = data.get("loads", [data])
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


def loads_sample(data, now: float) -> LoadSample | None:
    """/v1/loads: one record per data-parallel rank; requests add up, KV usage is the fullest rank."""
    ranks = _ranks(data)
    if not ranks:
        return None
    usage = [r["token_usage"] for r in ranks if isinstance(r.get("token_usage"), (int, float))]
    return LoadSample(running=sum(_num(r.get("num_running_reqs")) for r in ranks),
                      waiting=sum(_num(r.get("num_waiting_reqs")) for r in ranks),
                      kv_usage=max(usage) if usage else None, at=now)


def legacy_load_sample(data, now: float) -> LoadSample | None:
    """/get_load (older builds): num_reqs counts running and waiting together."""
    ranks = _ranks(data)
    if not ranks:
        return None
    waiting = sum(_num(r.get("num_waiting_reqs")) for r in ranks)
    return LoadSample(running=max(sum(_num(r.get("num_reqs")) for r in ranks) - waiting, 0.0), waiting=waiting,
                      at=now)
