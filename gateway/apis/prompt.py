"""What every API's prompt has in common: tool definitions as the templates render them, texts, counts, sessions."""

from __future__ import annotations

from typing import Any, Mapping

import orjson

from gateway.errors import bad_request


def json_text(value: Any, param: str) -> str:
    """A JSON value as text (sized and hashed like any prompt text); nesting deeper than orjson writes is a 400."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        raise bad_request(f"'{param}' is nested too deeply.", param=param) from None


def add_tools(tools: Any, parts: list[str]) -> int:
    """Tool definitions appended as one piece of prompt text (templates put them in the system prefix); 1 when
    there were any, for the template overhead."""
    if not isinstance(tools, list) or not tools:
        return 0
    parts += ("<tools>", json_text(tools, "tools"))
    return 1


def content_text(content: Any) -> str:
    """A chat message's content: a string, or the text parts of a multi-part content (others count nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def texts_of(value: Any) -> list[str]:
    """A prompt or input that is a string or a list of strings (token-id lists count nothing)."""
    if isinstance(value, list):
        return [p for p in value if isinstance(p, str)]
    return [value if isinstance(value, str) else ""]


def positive_int(value: Any) -> int | None:
    """A count a client set: a positive integer (a bool is none), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def single_cap(body: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    """The first of the output-cap fields that holds a positive integer."""
    for name in names:
        v = positive_int(body.get(name))
        if v is not None:
            return v
    return None


def session_fields(body: Mapping[str, Any]) -> str | None:
    """OpenAI's cache-bucketing hints, as a session: `prompt_cache_key`, else `user`."""
    for name in ("prompt_cache_key", "user"):
        v = body.get(name)
        if isinstance(v, str) and v:
            return v
    return None
