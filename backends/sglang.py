"""SGLang adapter: /health runs a one-token generation (503 while starting) and sglang: gauges."""

from backends.openai_http import OpenAIHTTPBackend


class SGLangBackend(OpenAIHTTPBackend):
    engine = "sglang"
    health_path = "/health"
    metrics_path = "/metrics"
    metric_names = {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
    }
