"""vLLM adapter: /health (connection refused while loading, 503 when the engine died) and vllm: gauges."""

from backends.openai_http import OpenAIHTTPBackend


class VLLMBackend(OpenAIHTTPBackend):
    engine = "vllm"
    health_path = "/health"
    metrics_path = "/metrics"
    metric_names = {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        # Older builds exposed the same gauge as gpu_cache_usage_perc.
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    }
