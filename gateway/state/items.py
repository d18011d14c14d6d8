"""Responses API items as the gateway keeps them (with ids) and as it sends them to an engine (without)."""

from __future__ import annotations

import secrets
from typing import Any, Final

from gateway.errors import bad_request

# Item types an engine is not sent again: a reasoning item replays nothing the open engines' templates keep.
NOT_REPLAYED: Final = frozenset({"reasoning"})
_PREFIX: Final = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def item_id(kind: str) -> str:
    return _PREFIX.get(kind, "item_") + secrets.token_hex(16)


class Ids:
    """Item ids for one request's items: one random draw, then a counter (ids name items inside records their
    owner alone reaches: unique, not secret)."""

    __slots__ = ("base", "n")

    def __init__(self) -> None:
        self.base = secrets.token_hex(12)
        self.n = 0

    def __call__(self, kind: str) -> str:
        self.n += 1
        return f"{_PREFIX.get(kind, 'item_')}{self.base}{self.n:04x}"


def stored_items(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """A request's `input` (a string or a list of items) as items with a type and an id: a string is a user message,
    a message's string content one text part (as OpenAI lists them). A 400 for what is no item."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"id": item_id("message"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    ids = Ids()
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a string or an array of items.", param=param, code="invalid_type")
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise bad_request(f"Each item of '{param}' must be an object.", param=param, code="invalid_type")
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if not isinstance(kind, str):
            raise bad_request(f"An item of '{param}' has no type.", param=param, code="invalid_type")
        one = {**item, "type": kind}
        content = one.get("content")
        if kind == "message" and isinstance(content, str):
            part = "output_text" if one.get("role") == "assistant" else "input_text"
            one["content"] = [{"type": part, "text": content}]
        rid = one.get("id")
        if not isinstance(rid, str) or not rid:
            one["id"] = ids(kind)
        out.append(one)
    return out


def output_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A Response's output items, each with an id (an engine's own, or one made here)."""
    output = response.get("output")
    if not isinstance(output, list):
        return []
    items = []
    for item in output:
        if isinstance(item, dict):
            if not isinstance(item.get("id"), str) or not item["id"]:
                item["id"] = item_id(str(item.get("type", "")))
            items.append(item)
    return items


def for_engine(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kept items as an engine takes them in `input`: without the ids and statuses only the gateway's lists show,
    and without the items no engine replays."""
    return [{k: v for k, v in it.items() if k != "id" and k != "status"} for it in items
            if it.get("type") not in NOT_REPLAYED]


def client_input(value: Any) -> list[Any]:
    """The request's own `input`, sent as it came after the kept history: a string as one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []
