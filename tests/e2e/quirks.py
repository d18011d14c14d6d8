"""What each real engine was observed to do on the wire, as data the engine and simulator tests assert against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineQuirks:
    engine: str
    # start-up
    loading_503: bool  # answers 503 while the model loads (else: refused until ready)
    health_ok_body: bytes
    # streaming chat
    first_chat_delta: dict[str, Any]
    finish_in_empty_delta: bool  # finish_reason in its own empty-delta chunk (else on the last content chunk)
    timings_on_last_chunk: bool
    usage_with_empty_stream_options: bool  # `stream_options: {}` alone turns the usage chunk on
    completions_stream_usage_by_default: bool  # /v1/completions stream carries usage without asking
    completion_id_prefix: str
    stream_options_without_stream_status: int
    continuous_usage_alone_sends_usage: bool  # `stream_options: {"continuous_usage_stats": true}` alone
    max_tokens_capped_at_context: bool  # max_tokens past the context: 200, output stops at the limit
    # errors
    unknown_model_status: int
    unknown_model_error_type: str | None
    overlong_error_type: str
    overlong_param: str | None
    # metrics
    metric_prefix: str
    has_histograms: bool
    running_gauge: str
    waiting_gauge: str
    fingerprint_prefix: str
    # connections
    closes_connection_after_stream: bool  # despite `Keep-Alive` in the stream's headers


LLAMACPP = EngineQuirks(
    engine="llamacpp",
    loading_503=True,
    health_ok_body=b'{"status":"ok"}',
    first_chat_delta={"role": "assistant", "content": None},
    finish_in_empty_delta=True,
    timings_on_last_chunk=True,
    usage_with_empty_stream_options=False,
    completions_stream_usage_by_default=True,
    completion_id_prefix="chatcmpl-",  # sic: the legacy route reuses the chat id prefix
    stream_options_without_stream_status=200,
    continuous_usage_alone_sends_usage=False,
    max_tokens_capped_at_context=True,
    unknown_model_status=200,  # any name is served, and the reply names the alias instead
    unknown_model_error_type=None,
    overlong_error_type="exceed_context_size_error",
    overlong_param=None,
    metric_prefix="llamacpp:",
    has_histograms=False,
    running_gauge="llamacpp:requests_processing",
    waiting_gauge="llamacpp:requests_deferred",
    fingerprint_prefix="b11434",
    closes_connection_after_stream=True,
)

VLLM = EngineQuirks(
    engine="vllm",
    loading_503=False,
    health_ok_body=b"",
    first_chat_delta={"role": "assistant", "content": ""},
    finish_in_empty_delta=False,
    timings_on_last_chunk=False,
    usage_with_empty_stream_options=False,  # 0.32 CPU: `{}` alone gives no usage chunk
    completions_stream_usage_by_default=False,
    completion_id_prefix="cmpl-",
    stream_options_without_stream_status=400,
    continuous_usage_alone_sends_usage=False,  # include_usage must be true as well
    max_tokens_capped_at_context=True,  # 0.32 no longer refuses prompt + max_tokens > max_model_len
    unknown_model_status=404,
    unknown_model_error_type="NotFoundError",
    overlong_error_type="BadRequestError",
    overlong_param="input_tokens",
    metric_prefix="vllm:",
    has_histograms=True,
    running_gauge="vllm:num_requests_running",
    waiting_gauge="vllm:num_requests_waiting",
    fingerprint_prefix="vllm-0.32.0",
    closes_connection_after_stream=False,
)

QUIRKS = {q.engine: q for q in (LLAMACPP, VLLM)}


def check_connection_after_reply(q: EngineQuirks, head: bytes, closed: bool, stream: bool) -> None:
    """What an engine does with the connection after a 200 reply: llama-server closes it after a stream
    although its head says Keep-Alive; the others keep it. The real engines and the simulator are held
    to the same check."""
    assert head.startswith(b"HTTP/1.1 200")
    assert closed == (stream and q.closes_connection_after_stream)
    if closed:
        assert b"keep-alive: timeout=" in head.lower() and b"connection: close" not in head.lower()
