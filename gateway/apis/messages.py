"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): body checks, prompt, events, error shape."""

from __future__ import annotations

from typing import Any, Final, Mapping

import orjson

from gateway.apis.api import Api, ErrorShape, Meter, StreamRules, texts
from gateway.apis.prompt import add_tools, positive_int
from gateway.errors import GatewayError, bad_request, error_from_event

# Anthropic's error types by status; 503 leaves as Anthropic's own "overloaded" status, 529, which its SDKs retry.
_TYPES: Final = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                 413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error",
                 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
OVERLOADED: Final[int] = 529


def status_of(err: GatewayError) -> int:
    return OVERLOADED if err.status == 503 else err.status


def error_payload(err: GatewayError, request_id: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    out: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": err.message}}
    if request_id is not None:
        out["request_id"] = request_id
    return out


def error_body(err: GatewayError, request_id: str) -> bytes:
    return orjson.dumps(error_payload(err, request_id))


def error_event(err: GatewayError, last: bytes = b"") -> bytes:
    return b"event: error\ndata: " + orjson.dumps(error_payload(err)) + b"\n\n"


class AnthropicErrors(ErrorShape):
    """Anthropic's error shape and status codes (503 leaves as 529, which its SDKs retry)."""

    def status_of(self, err: GatewayError) -> int:
        return status_of(err)

    def body(self, err: GatewayError, request_id: str) -> bytes:
        return error_body(err, request_id)

    def event(self, err: GatewayError, last: bytes) -> bytes:
        return error_event(err, last)


ANTHROPIC_ERRORS: Final[ErrorShape] = AnthropicErrors()


def check(body: Mapping[str, Any], needs_max_tokens: bool) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: Field required (a non-empty array).", param="messages",
                          code="missing_required_parameter")
    if needs_max_tokens:
        n = body.get("max_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise bad_request("max_tokens: Field required (a positive integer).", param="max_tokens",
                              code="missing_required_parameter")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise bad_request("system: a string or an array of text blocks.", param="system", code="invalid_type")


def _blocks_text(content: Any, out: list[str]) -> None:
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                continue
            text = block.get("text")
            if isinstance(text, str):
                out.append(text)
            elif block.get("type") == "tool_result":
                _blocks_text(block.get("content"), out)
            elif block.get("type") == "tool_use" and isinstance(block.get("input"), dict):
                try:
                    out.append(orjson.dumps(block["input"]).decode())
                except orjson.JSONEncodeError:
                    raise bad_request("messages: a tool_use input is nested too deeply.", param="messages") from None


def prompt_parts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """system, tool definitions and messages in order."""
    parts: list[str] = []
    n = 0
    system = body.get("system")
    if system is not None:
        parts.append("<system>")
        _blocks_text(system, parts)
        n += 1
    n += add_tools(body.get("tools"), parts)
    for m in body.get("messages") or ():
        if isinstance(m, dict):
            parts += ("<", str(m.get("role", "")), ">")
            _blocks_text(m.get("content"), parts)
            n += 1
    return parts, n


def requested_output(body: Mapping[str, Any]) -> int | None:
    return positive_int(body.get("max_tokens"))


def session(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, dict) else None
    return user if isinstance(user, str) and user else None


# -- its stream ---------------------------------------------------------------------------------------------------
TOKEN_MARK: Final[bytes] = b'"content_block_delta"'
SPECIAL: Final[tuple[bytes, ...]] = (b'"message_start"', b'"message_delta"', b'"message_stop"', b'"error"')


def usage_of_message(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Message's usage (or a message_delta's) in the chat form the gateway counts in."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    out: dict[str, Any] = {}
    if isinstance(u.get("input_tokens"), int):
        out["prompt_tokens"] = u["input_tokens"]
    if isinstance(u.get("output_tokens"), int):
        out["completion_tokens"] = u["output_tokens"]
    cached = u.get("cache_read_input_tokens")
    if isinstance(cached, int):
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def error_of(obj: Mapping[str, Any]) -> GatewayError:
    """An Anthropic error event ({"type": "error", "error": {type, message}}) as a GatewayError with its status."""
    err = obj.get("error")
    if not isinstance(err, dict):
        message = obj.get("message")
        return GatewayError(500, message if isinstance(message, str) else "The engine reported an error.",
                            code="server_error")
    kind = err.get("type")
    status = 529 if kind == "overloaded_error" else 400 if kind == "invalid_request_error" else 500
    return error_from_event({"error": {**err, "code": err.get("code", status)}})


class MessagesStream(StreamRules):
    """Usage from message_start (input) and message_delta (output), the end at message_stop."""

    def note(self, obj: dict[str, Any], meter: Meter) -> None:
        kind = obj.get("type")
        if kind == "message_start":
            msg = obj.get("message")
            u = usage_of_message(msg) if isinstance(msg, dict) else None
            if u:
                meter.usage = {**(meter.usage or {}), **u}
        elif kind == "message_delta":
            u = usage_of_message(obj)
            if u:
                meter.usage = {**(meter.usage or {}), **u}
            meter.saw_finish = True
        elif kind == "message_stop":
            meter.saw_done = True
        elif kind == "error":
            meter.error = error_of(obj)
            meter.saw_done = True


class Messages(Api):
    def check(self, body: dict[str, Any]) -> None:
        check(body, needs_max_tokens=self.generating)

    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        return prompt_parts(body)

    def requested_output(self, body: Mapping[str, Any]) -> int | None:
        return requested_output(body) if self.generating else None

    def session(self, body: Mapping[str, Any]) -> str | None:
        return session(body)

    def reply_text(self, doc: dict[str, Any]) -> str:
        """Content blocks of type text."""
        return texts(doc.get("content"), "text")

    def event_text(self, doc: dict[str, Any]) -> str:
        delta = doc.get("delta") if doc.get("type") == "content_block_delta" else None
        text = delta.get("text") if isinstance(delta, dict) else None
        return text if isinstance(text, str) else ""


_HEADERS: Final = (("anthropic-version", "anthropic-version"), ("anthropic-beta", "anthropic-beta"))
MESSAGES: Final[Api] = Messages("messages", "/v1/messages", "/v1/messages", generating=True, passed_headers=_HEADERS,
                                stream=MessagesStream(TOKEN_MARK, SPECIAL, ANTHROPIC_ERRORS), errors=ANTHROPIC_ERRORS,
                                shadow=True)
COUNT_TOKENS: Final[Api] = Messages("count_tokens", "/v1/messages/count_tokens", "/v1/messages/count_tokens",
                                    passed_headers=_HEADERS, errors=ANTHROPIC_ERRORS)
