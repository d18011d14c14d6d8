"""What every API's prompt has in common: tool definitions as the templates render them, a positive count."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import bad_request


def add_tools(tools: Any, parts: list[str]) -> int:
    """Tool definitions appended as one piece of prompt text (templates put them in the system prefix); 1 when
    there were any, for the template overhead."""
    if not isinstance(tools, list) or not tools:
        return 0
    try:
        parts += ("<tools>", orjson.dumps(tools).decode())
    except orjson.JSONEncodeError:
        raise bad_request("'tools' is nested too deeply.", param="tools") from None
    return 1


def positive_int(value: Any) -> int | None:
    """A count a client set: a positive integer (a bool is none), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
