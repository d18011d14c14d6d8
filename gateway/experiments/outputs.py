"""The text a reply holds, in each API's form: what a shadow copy's output is compared on."""

from __future__ import annotations

from typing import Any

import orjson


def output_of(data: bytes, stream: bool, route: str) -> tuple[str, list[str] | None]:
    """The reply's text (the first choice's, on chat and completions), and for a stream its pieces: one per event,
    which is a token each on the engines."""
    if not stream:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "", None
        if not isinstance(doc, dict):
            return "", None
        return _whole(doc, route), None
    pieces = []
    for event in data.split(b"\n\n"):
        i = event.find(b"data:")  # (after an `event:` line on the typed APIs)
        if i < 0:
            continue
        payload = event[i + 5:].strip()
        if payload == b"[DONE]":
            break
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        piece = _piece(doc, route) if isinstance(doc, dict) else ""
        if piece:
            pieces.append(piece)
    return "".join(pieces), pieces


def _whole(doc: dict[str, Any], route: str) -> str:
    """A whole reply's text."""
    if route == "responses":  # output items of type message, their output_text parts
        return "".join(_texts(item.get("content"), "output_text") for item in _dicts(doc.get("output"))
                       if item.get("type") == "message")
    if route == "messages":  # content blocks of type text
        return _texts(doc.get("content"), "text")
    return _choice_text(doc, "message")


def _piece(doc: dict[str, Any], route: str) -> str:
    """One stream event's text."""
    if route == "responses":
        delta = doc.get("delta")
        return delta if doc.get("type") == "response.output_text.delta" and isinstance(delta, str) else ""
    if route == "messages":
        delta = doc.get("delta") if doc.get("type") == "content_block_delta" else None
        text = delta.get("text") if isinstance(delta, dict) else None
        return text if isinstance(text, str) else ""
    return _choice_text(doc, "delta")


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _texts(parts: Any, kind: str) -> str:
    return "".join(p["text"] for p in _dicts(parts) if p.get("type") == kind and isinstance(p.get("text"), str))


def _choice_text(doc: dict[str, Any], key: str) -> str:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return ""
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            m = c.get(key)
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                return m["content"]
            return c["text"] if isinstance(c.get("text"), str) else ""
    return ""
