"""llama.cpp adapter: /health 503 "Loading model", llamacpp: gauges, idle slots from /slots, no [DONE] after errors."""

from __future__ import annotations

import time

import orjson

from backends.openai_http import OpenAIHTTPBackend, count, load_from_gauges, parse_gauges
from gateway.apis.registry import ENGINE_APIS
from gateway.contracts import LoadSample


class LlamaCppBackend(OpenAIHTTPBackend):
    engine = "llamacpp"
    # (rerank needs --rerank, transcriptions a model that hears: a 404 or a refusal says so per request)
    apis = ENGINE_APIS - {"response", "response_cancel", "score", "translations"}
    health_path = "/health"
    metrics_path = "/metrics"
    slots_path = "/slots"
    metric_names = {
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
        "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
        # Prompt and generation throughput since the previous scrape: the engine's own prefill rate and ITL.
        "prompt_tps": ("llamacpp:prompt_tokens_seconds",),
        "predicted_tps": ("llamacpp:predicted_tokens_seconds",),
    }
    needs_max_tokens = True
    props_path = "/props"
    # Its prompt and generation timings: on a non-streamed reply, and on a stream's finish or usage chunk (every
    # chunk when the client asks for `timings_per_token`).
    private_fields = ("timings",)

    async def context_window(self, model: str, timeout: float) -> int | None:
        """The per-slot context (-c split over --parallel): what one request may hold here."""
        settings = await self._get_field(self.props_path, "default_generation_settings", timeout)
        return count(settings.get("n_ctx")) if isinstance(settings, dict) else None

    async def sample_load(self, timeout: float) -> LoadSample | None:
        # /slots is on by default; /metrics only with --metrics, so either may be missing.
        status, body = await self._get(self.slots_path, timeout)
        idle = total = None
        if status == 200:
            slots = orjson.loads(body)
            if isinstance(slots, list):
                total = len(slots)
                idle = sum(1 for s in slots if isinstance(s, dict) and not s.get("is_processing"))
        status, body = await self._get(self.metrics_path, timeout)
        g = parse_gauges(body.decode("utf-8", "replace"), self.metric_names) if status == 200 else {}
        running = g.get("running", None if total is None or idle is None else float(total - idle))
        if total is None and not g:
            return None
        return load_from_gauges(g, time.monotonic(), running=running, idle_slots=idle, total_slots=total)
