"""Wire formats of each engine: error bodies, response bodies and SSE chunks for chat and text completions."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.sim import chat_tools
from gateway.sim.forced import ToolCall
from gateway.sim.tokens import EOS_ID, Output

DONE = b"data: [DONE]\n\n"
VLLM_FINGERPRINT = "vllm-0.32.0-sim"
_SENTINEL = "\x00sim-piece\x00"


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


@dataclass
class Reply:
    """One generation request as the formatter needs it."""

    kind: str  # "chat" or "text"
    model: str
    output: Output
    prompt_tokens: int
    include_usage: bool = False
    continuous_usage: bool = False
    report_cached: bool = False
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int = 0
    timings: dict[str, float] | None = None
    tool_call: ToolCall | None = None  # a function call the grammar forced
    finish: str = ""  # finish_reason as reported (a forced call may turn "stop" into "tool_calls")

    def __post_init__(self) -> None:
        self.finish = self.finish or self.output.finish_reason

    def piece(self, i: int) -> str | dict[str, Any]:
        """What output token `i` adds to a chat delta: text, or a tool call delta."""
        if self.tool_call is None:
            return self.output.pieces[i]
        return chat_tools.delta(self.tool_call, self.output.pieces[i], first=i == 0)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if self.report_cached and self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


class EngineFormat:
    """vLLM's format; the other engines override what differs."""

    engine = "vllm"
    error_types = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                   501: "NotImplementedError", 503: "ServiceUnavailableError"}
    done_after_error = True  # a mid-stream error is followed by [DONE]
    stream_opens_early = True  # headers go out before the first token (llama.cpp waits for it)
    first_content: str | None = ""  # content of the role-only first chat chunk
    sse_content_type = "text/event-stream; charset=utf-8"
    # llama-server drops the connection after a streamed reply, although its headers say Keep-Alive
    closes_after_stream = False

    def new_id(self, kind: str) -> str:
        return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex

    # -- errors --------------------------------------------------------------------------------
    def error_type(self, status: int) -> str:
        return self.error_types.get(status, "InternalServerError" if status >= 500 else "BadRequestError")

    def error(self, status: int, message: str, type_: str | None = None,
              param: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"error": {"message": message, "type": type_ or self.error_type(status),
                          "param": param, "code": status}}

    def stream_error(self, status: int, message: str, type_: str | None = None) -> dict[str, Any]:
        return self.error(status, message, type_)

    # -- stop details --------------------------------------------------------------------------
    def stop_fields(self, output: Output) -> dict[str, Any]:
        return {"stop_reason": output.stop_string}

    # -- stream --------------------------------------------------------------------------------
    def envelope(self, reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
        return {"id": reply.rid, "object": obj, "created": reply.created, "model": reply.model,
                "choices": choices}

    def choice(self, reply: Reply, text: str | dict[str, Any] | None, role: bool = False,
               finish: str | None = None) -> dict[str, Any]:
        extra = self.stop_fields(reply.output) if finish else {}
        if reply.kind == "text":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish,
                    **({"stop_reason": None} if not finish else extra)}
        if isinstance(text, dict):
            delta: dict[str, Any] = text
        else:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}

    def chunk(self, reply: Reply, choices: list[dict[str, Any]], generated: int) -> dict[str, Any]:
        event = self.envelope(reply, choices)
        if reply.continuous_usage:
            event["usage"] = reply.usage(generated)
        return event

    def stream_events(self, reply: Reply, start: int, stop: int, last: bool) -> list[dict[str, Any]]:
        """Events for tokens [start, stop); `last` when the request ends with them.

        vLLM sends the role chunk with the first token and puts finish_reason on the last
        content chunk.
        """
        pieces = reply.output.pieces
        events = []
        if start == 0 and reply.kind == "chat":
            events.append(self.chunk(reply, [self.choice(reply, self.first_content, role=True)], 0))
        for i in range(start, stop):
            finish = reply.finish if last and i == stop - 1 else None
            if pieces[i] or finish:
                events.append(self.chunk(reply, [self.choice(reply, reply.piece(i), finish=finish)],
                                         i + 1))
        if last and events and not reply.include_usage:
            events[-1].update(self.fingerprint_field())
        return events

    def tail_events(self, reply: Reply, generated: int) -> list[dict[str, Any]]:
        """After the last token: the usage chunk when asked for."""
        if not reply.include_usage:
            return []
        return [{**self.envelope(reply, []), "usage": reply.usage(generated),
                 **self.fingerprint_field()}]

    def fingerprint_field(self) -> dict[str, Any]:
        # vLLM 0.32 names its version on the last chunk of a stream and in full responses.
        return {"system_fingerprint": VLLM_FINGERPRINT} if self.engine == "vllm" else {}

    def content_template(self, reply: Reply) -> tuple[bytes, bytes] | None:
        """Bytes around a token's JSON string in a plain content chunk, for the fast path."""
        if reply.continuous_usage or reply.tool_call is not None:
            return None
        raw = sse(self.chunk(reply, [self.choice(reply, _SENTINEL)], 0))
        head, _, tail = raw.partition(orjson.dumps(_SENTINEL))
        return head, tail

    # -- full responses ------------------------------------------------------------------------
    def message(self, content: str) -> dict[str, Any]:
        return {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": [], "reasoning": None}

    def chat_message(self, reply: Reply) -> dict[str, Any]:
        message = self.message(reply.output.text)
        if reply.tool_call is not None:
            message.update(chat_tools.message_fields(self.engine, reply.tool_call))
        return message

    def response(self, reply: Reply, generated: int) -> dict[str, Any]:
        out = reply.output
        finish = {"finish_reason": reply.finish, **self.stop_fields(out)}
        if reply.kind == "chat":
            choice = {"index": 0, "message": self.chat_message(reply), "logprobs": None, **finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, **finish,
                      "prompt_logprobs": None}
            obj = "text_completion"
        usage = reply.usage(generated)
        usage.setdefault("prompt_tokens_details", None)
        return {"id": reply.rid, "object": obj, "created": reply.created, "model": reply.model,
                "choices": [choice], "service_tier": None, "system_fingerprint": VLLM_FINGERPRINT,
                "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}


class SglangFormat(EngineFormat):
    """SGLang: flat error body, `matched_stop`, finish_reason in its own chat chunk."""

    engine = "sglang"
    error_types = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                   503: "ServiceUnavailableError"}

    def new_id(self, kind: str) -> str:
        return uuid.uuid4().hex

    def error(self, status: int, message: str, type_: str | None = None,
              param: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"object": "error", "message": message, "type": type_ or self.error_type(status),
                "param": param, "code": status}

    def stream_error(self, status: int, message: str, type_: str | None = None) -> dict[str, Any]:
        return {"error": self.error(status, message, type_)}

    def stop_fields(self, output: Output) -> dict[str, Any]:
        if output.stop_string is not None:
            return {"matched_stop": output.stop_string}
        return {"matched_stop": EOS_ID if output.finish_reason == "stop" else None}

    def envelope(self, reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**super().envelope(reply, choices), "usage": None}

    def choice(self, reply: Reply, text: str | dict[str, Any] | None, role: bool = False,
               finish: str | None = None) -> dict[str, Any]:
        stop = self.stop_fields(reply.output) if finish else {"matched_stop": None}
        if reply.kind == "text":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish, **stop}
        if isinstance(text, dict):
            delta: dict[str, Any] = text
        elif finish and text is None:
            delta = {}
        else:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **stop}

    def stream_events(self, reply: Reply, start: int, stop: int, last: bool) -> list[dict[str, Any]]:
        if reply.kind == "text":
            return super().stream_events(reply, start, stop, last)
        events = []
        if start == 0:
            events.append(self.chunk(reply, [self.choice(reply, "", role=True)], 0))
        for i in range(start, stop):
            if reply.output.pieces[i]:
                events.append(self.chunk(reply, [self.choice(reply, reply.piece(i))], i + 1))
        if last:
            finish = self.choice(reply, None, finish=reply.finish)
            events.append(self.chunk(reply, [finish], stop))
        return events

    def message(self, content: str) -> dict[str, Any]:
        return {"role": "assistant", "content": content, "reasoning_content": None,
                "tool_calls": None}

    def response(self, reply: Reply, generated: int) -> dict[str, Any]:
        out = reply.output
        finish = {"finish_reason": reply.finish, **self.stop_fields(out)}
        if reply.kind == "chat":
            choice = {"index": 0, "message": self.chat_message(reply), "logprobs": None, **finish}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, **finish}
        usage = reply.usage(generated)
        usage.setdefault("prompt_tokens_details", None)
        return {"id": reply.rid, "object": "chat.completion" if reply.kind == "chat"
                else "text_completion", "created": reply.created, "model": reply.model,
                "choices": [choice], "usage": usage, "metadata": {"weight_version": "default"}}


class LlamaFormat(EngineFormat):
    """llama.cpp: `{"error": {code, message, type}}`, role chunk with null content, `timings`."""

    engine = "llamacpp"
    error_types = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 500: "server_error",
                   501: "not_supported_error", 503: "unavailable_error"}
    done_after_error = False
    stream_opens_early = False
    first_content = None
    fingerprint = "b11434-sim"
    sse_content_type = "text/event-stream"
    closes_after_stream = True

    def new_id(self, kind: str) -> str:
        return "chatcmpl-" + secrets.token_urlsafe(24).replace("-", "a").replace("_", "b")[:32]

    def error_type(self, status: int) -> str:
        return self.error_types.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def error(self, status: int, message: str, type_: str | None = None,
              param: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"error": {"code": status, "message": message,
                          "type": type_ or self.error_type(status), **extra}}

    def stop_fields(self, output: Output) -> dict[str, Any]:
        return {}

    def envelope(self, reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
        return {"choices": choices, "created": reply.created, "id": reply.rid,
                "model": reply.model, "system_fingerprint": self.fingerprint, "object": obj}

    def choice(self, reply: Reply, text: str | dict[str, Any] | None, role: bool = False,
               finish: str | None = None) -> dict[str, Any]:
        if reply.kind == "text":
            return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        if isinstance(text, dict):
            delta: dict[str, Any] = text
        elif finish:
            delta = {}
        else:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
        return {"finish_reason": finish, "index": 0, "delta": delta}

    def stream_events(self, reply: Reply, start: int, stop: int, last: bool) -> list[dict[str, Any]]:
        events = []
        if start == 0 and reply.kind == "chat":
            events.append(self.chunk(reply, [self.choice(reply, None, role=True)], 0))
        for i in range(start, stop):
            if reply.output.pieces[i]:
                events.append(self.chunk(reply, [self.choice(reply, reply.piece(i))], i + 1))
        if last:
            event = self.chunk(reply, [self.choice(reply, None, finish=reply.finish)], stop)
            if reply.kind == "text":
                # /v1/completions: usage and timings on the finish chunk, asked for or not
                event["usage"] = self.usage(reply, stop)
            if (reply.kind == "text" or not reply.include_usage) and reply.timings is not None:
                event["timings"] = reply.timings  # timings ride on the last chunk
            events.append(event)
        return events

    def usage(self, reply: Reply, generated: int) -> dict[str, Any]:
        usage = reply.usage(generated)
        usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
        return usage

    def tail_events(self, reply: Reply, generated: int) -> list[dict[str, Any]]:
        if not reply.include_usage or reply.kind == "text":
            return []
        usage = self.usage(reply, generated)
        event = {**self.envelope(reply, []), "usage": usage}
        if reply.timings is not None:
            event["timings"] = reply.timings
        return [event]

    def response(self, reply: Reply, generated: int) -> dict[str, Any]:
        out = reply.output
        if reply.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            if reply.tool_call is not None:
                message.update(chat_tools.message_fields(self.engine, reply.tool_call))
            choice: dict[str, Any] = {"finish_reason": reply.finish, "index": 0, "message": message}
        else:
            choice = {"text": out.text, "index": 0, "logprobs": None, "finish_reason": reply.finish}
        usage = reply.usage(generated)
        usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
        return {"choices": [choice], "created": reply.created, "model": reply.model,
                "system_fingerprint": self.fingerprint,
                "object": "chat.completion" if reply.kind == "chat" else "text_completion",
                "usage": usage, "id": reply.rid, "timings": reply.timings}


FORMATS: dict[str, type[EngineFormat]] = {
    "vllm": EngineFormat, "sglang": SglangFormat, "llamacpp": LlamaFormat,
}
