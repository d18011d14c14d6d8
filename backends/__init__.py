"""Engine adapters, one per file; REGISTRY maps the config's `engine` to its adapter class."""

from backends.llamacpp import LlamaCppBackend
from backends.openai import OpenAIBackend
from backends.openai_http import OpenAIHTTPBackend
from backends.sglang import SGLangBackend
from backends.vllm import VLLMBackend

REGISTRY: dict[str, type[OpenAIHTTPBackend]] = {
    "vllm": VLLMBackend,
    "sglang": SGLangBackend,
    "llamacpp": LlamaCppBackend,
    "openai": OpenAIBackend,
}


def engine_names() -> tuple[str, ...]:
    """The engine names a configuration may use: the registry's, so that a new adapter needs no other list."""
    return tuple(REGISTRY)
