"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): body checks, prompt, events, error shape."""

from __future__ import annotations

from typing import Any, Final, Mapping

import orjson

from gateway.apis.prompt import add_tools, positive_int
from gateway.errors import GatewayError, bad_request

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


def check(route: str, body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: Field required (a non-empty array).", param="messages",
                          code="missing_required_parameter")
    if route == "messages":
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
