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
