"""A stored response as the store keeps it (one JSON object, its status first), and a cache of recent ones."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson


def record_of(status: str, prev: str | None, chain: list[str], conversation: str | None,
              items: list[dict[str, Any]], response: dict[str, Any]) -> dict[str, Any]:
    """A record as a dict (encode_record's, before it is encoded)."""
    return {"status": status, "prev": prev, "chain": chain, "conversation": conversation, "input": items,
            "response": response}


def encode_record(status: str, prev: str | None, chain: list[str], conversation: str | None,
                  items: list[dict[str, Any]], response: dict[str, Any]) -> bytes:
    """The record of a response: its status (first, so the store reads it without parsing), the responses it
    continues (`chain`: every response before it, oldest first, `prev` last), its conversation, its own input items
    and the Response."""
    return orjson.dumps(record_of(status, prev, chain, conversation, items, response))


def decode_record(data: bytes) -> dict[str, Any] | None:
    """A record read back (None: not one the gateway wrote; the store's data is checked, never trusted)."""
    try:
        rec = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("response"), dict) or not isinstance(rec.get("input"), list):
        return None
    chain = rec.get("chain")
    if not isinstance(chain, list) or not all(isinstance(c, str) for c in chain):
        return None
    if not isinstance(rec.get("status"), str) or not isinstance(rec.get("prev"), (str, type(None))):
        return None
    return rec


class RecordCache:
    """Finished responses this process wrote or read lately, parsed, least recent first out within `max_bytes`.

    Only ever used after the store said the ids still exist (one round trip for a whole chain): a response deleted
    or expired elsewhere is never continued from here."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[dict[str, Any], int]] = OrderedDict()
        self._bytes = 0

    def get(self, owner: str, rid: str) -> dict[str, Any] | None:
        entry = self._entries.get((owner, rid))
        if entry is None:
            return None
        self._entries.move_to_end((owner, rid))
        return entry[0]

    def put(self, owner: str, rid: str, data: bytes, rec: dict[str, Any] | None = None) -> None:
        if len(data) > self.max_bytes:
            return
        if rec is None:
            rec = decode_record(data)
            if rec is None:
                return
        self.forget(owner, rid)
        self._entries[(owner, rid)] = (rec, len(data))
        self._bytes += len(data)
        while self._bytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self._bytes -= size

    def forget(self, owner: str, rid: str) -> None:
        entry = self._entries.pop((owner, rid), None)
        if entry is not None:
            self._bytes -= entry[1]
