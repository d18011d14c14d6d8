"""Adapter for any other OpenAI-compatible server: health is a model list, no load signals."""

from backends.openai_http import OpenAIHTTPBackend


class OpenAIBackend(OpenAIHTTPBackend):
    engine = "openai"
    health_path = "/v1/models"
