"""vLLM adapter: /health (connection refused while loading, 503 when the engine died) and vllm: gauges."""

from backends.openai_http import OpenAIHTTPBackend
from gateway.apis.registry import ENGINE_APIS


class VLLMBackend(OpenAIHTTPBackend):
    engine = "vllm"
    apis = ENGINE_APIS - {"responses_input_tokens"}
    health_path = "/health"
    metrics_path = "/metrics"
    metric_names = {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        # Older builds exposed the same gauge as gpu_cache_usage_perc.
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        # The engine's own TTFT and inter-token histograms (the older name of the latter before 0.11).
        "ttft_sum": ("vllm:time_to_first_token_seconds_sum",),
        "ttft_count": ("vllm:time_to_first_token_seconds_count",),
        "itl_sum": ("vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"),
        "itl_count": ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
    }
