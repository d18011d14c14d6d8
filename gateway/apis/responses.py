"""OpenAI's Responses API (/v1/responses): body checks, prompt text, session, stored ids and its stream's events."""

from __future__ import annotations

import re
from typing import Any, Final, Mapping

import orjson

from gateway.apis.table import RESPONSE_ID
from gateway.apis.prompt import add_tools, positive_int
from gateway.errors import GatewayError, bad_request


def check(body: Mapping[str, Any]) -> None:
    """What routing needs of a Responses body (the engine checks the rest): `input` a string or a list of items."""
    if "input" not in body and not isinstance(body.get("previous_response_id"), str):
        raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    value = body.get("input")
    if value is not None and not isinstance(value, (str, list)):
        raise bad_request("'input' must be a string or an array of input items.", param="input",
                          code="invalid_type")
    prev = body.get("previous_response_id")
    if prev is not None and not (isinstance(prev, str) and RESPONSE_ID.fullmatch(prev)):
        raise not_found(None, "previous_response_id")
    for name in ("instructions",):
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string.", param=name, code="invalid_type")


def not_found(response_id: str | None, param: str = "response_id") -> GatewayError:
    """An unknown id, an id another key made and an id of an unknown form get the same answer: no tenant can tell a
    foreign id from a missing one. The id is echoed only when it has the form of one."""
    shown = f" '{response_id}'" if response_id is not None and RESPONSE_ID.fullmatch(response_id) else ""
    return GatewayError(404, f"Response with id{shown} not found.", param=param, code="response_not_found")


def _item_text(item: Any, out: list[str]) -> int:
    """The text of one input item (a message, a function call or its output): appended to out; 1 per message."""
    if isinstance(item, str):
        out.append(item)
        return 0
    if not isinstance(item, dict):
        return 0
    content = item.get("content")
    if isinstance(content, str):
        out += ("<", str(item.get("role", "")), ">", content)
        return 1
    if isinstance(content, list):
        out += ("<", str(item.get("role", "")), ">")
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return 1
    for name in ("arguments", "output"):  # function_call / function_call_output items
        v = item.get(name)
        if isinstance(v, str):
            out.append(v)
    return 0


def prompt_parts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """instructions, tool definitions and input, in order, as the engines' templates put them."""
    parts: list[str] = []
    n = 0
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        parts += ("<system>", instructions)
        n += 1
    n += add_tools(body.get("tools"), parts)
    value = body.get("input")
    if isinstance(value, str):
        parts += ("<user>", value)
        n += 1
    elif isinstance(value, list):
        for item in value:
            n += _item_text(item, parts)
    return parts, n


def requested_output(body: Mapping[str, Any]) -> int | None:
    return positive_int(body.get("max_output_tokens"))


def session(body: Mapping[str, Any]) -> str | None:
    """A conversation's own ids make its session: the conversation, else the response it continues."""
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    if isinstance(conv, str) and conv:
        return conv
    for name in ("prompt_cache_key", "user", "previous_response_id"):
        v = body.get(name)
        if isinstance(v, str) and v:
            return v
    return None


def stores(body: Mapping[str, Any]) -> bool:
    """Whether the engine keeps this response (`store` defaults to true)."""
    return body.get("store") is not False


def id_of(reply: Mapping[str, Any]) -> str | None:
    """A Response object's id when it has the form of one (an engine's text is never used as a key otherwise)."""
    rid = reply.get("id")
    return rid if isinstance(rid, str) and RESPONSE_ID.fullmatch(rid) else None


# -- its stream ---------------------------------------------------------------------------------------------------
# An event with output: each `*.delta` type (text, reasoning, refusal, function-call arguments). A JSON string
# ending in `.delta"` inside a delta's own text is escaped (`\"`), so the quote marks the type's end.
TOKEN_MARK: Final[bytes] = b'.delta"'
# Events worth parsing: the first (its id), the last (usage, status) and failures.
SPECIAL: Final[tuple[bytes, ...]] = (b'"response.created"', b'"response.completed"', b'"response.incomplete"', b'"response.failed"',
                  b'"error"')
_SEQ: Final = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


def usage(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Response's usage in the chat form the gateway counts in (prompt_tokens, completion_tokens, cached)."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    out: dict[str, Any] = {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens")}
    details = u.get("input_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


def error_event(err: GatewayError, last: bytes) -> bytes:
    """The stream's own error event, numbered after the last event the client got."""
    found = _SEQ.findall(last)
    seq = int(found[-1]) + 1 if found else 0
    payload = {"type": "error", "code": err.code or "server_error", "message": err.message, "param": err.param,
               "sequence_number": seq}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
