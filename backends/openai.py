"""Adapter for any other OpenAI-compatible server: health is a model list, no load signals, every API tried."""

from backends.openai_http import OpenAIHTTPBackend
from gateway.apis.registry import ENGINE_APIS


class OpenAIBackend(OpenAIHTTPBackend):
    engine = "openai"
    # Any server: every route is tried, and one it answers as an unknown path is not sent there again.
    apis = ENGINE_APIS
    health_path = "/v1/models"
