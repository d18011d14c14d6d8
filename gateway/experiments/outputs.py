"""The text a reply holds, in its API's form (gateway/apis/): what a shadow copy's output is compared on."""

from __future__ import annotations

import orjson

from gateway.apis.api import Api


def output_of(data: bytes, stream: bool, api: Api) -> tuple[str, list[str] | None]:
    """The reply's text (the first choice's, on chat and completions), and for a stream its pieces: one per event,
    which is a token each on the engines."""
    if not stream:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "", None
        if not isinstance(doc, dict):
            return "", None
        return api.reply_text(doc), None
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
        piece = api.event_text(doc) if isinstance(doc, dict) else ""
        if piece:
            pieces.append(piece)
    return "".join(pieces), pieces
