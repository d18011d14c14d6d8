"""Adapter for any other OpenAI-compatible server: health is a model list, no load signals, every API tried."""

from backends.openai_http import OpenAIHTTPBackend


class OpenAIBackend(OpenAIHTTPBackend):
    engine = "openai"
    # Any server: every route is tried, and one it answers as an unknown path is not sent there again.
    apis = frozenset({"chat", "completions", "embeddings", "responses", "response", "response_cancel",
                      "responses_input_tokens", "messages", "count_tokens", "rerank", "score", "transcriptions",
                      "translations"})
    health_path = "/v1/models"
