"""OpenAI's Conversations API (/v1/conversations and its items): routes, body checks and the objects it answers with.

Served by the gateway itself from its own state (gateway/state/), on every engine: a Responses request naming a
conversation gets its items as the input before its own, and adds its input and output items to it."""

from __future__ import annotations

import secrets
import time
from typing import Any, Final, Mapping

from gateway.apis.api import NONE, Api, parse_json
from gateway.apis.responses import RESPONSE_ID
from gateway.errors import GatewayError, bad_request

MAX_ITEMS_PER_CALL: Final[int] = 20  # items one create (of a conversation, or of its items) may add
MAX_METADATA: Final[int] = 16  # key-value pairs
MAX_METADATA_KEY: Final[int] = 64
MAX_METADATA_VALUE: Final[int] = 512
DEFAULT_PAGE: Final[int] = 20
MAX_PAGE: Final[int] = 100


def new_id() -> str:
    return "conv_" + secrets.token_hex(24)


def not_found(conversation_id: str | None) -> GatewayError:
    """An unknown id and another key's id get the same answer."""
    shown = f" '{conversation_id}'" if conversation_id is not None and RESPONSE_ID.fullmatch(conversation_id) else ""
    return GatewayError(404, f"Conversation with id{shown} not found.", param="conversation_id",
                        code="conversation_not_found")


def item_not_found(item_id: str) -> GatewayError:
    shown = f" '{item_id}'" if RESPONSE_ID.fullmatch(item_id) else ""
    return GatewayError(404, f"Item with id{shown} not found.", param="item_id", code="item_not_found")


def metadata_of(body: Mapping[str, Any]) -> dict[str, str] | None:
    """`metadata` as OpenAI bounds it: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    meta = body.get("metadata")
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(meta) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in meta.items()):
        raise bad_request(f"'metadata' must be an object of at most {MAX_METADATA} string pairs (keys up to "
                          f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}).", param="metadata",
                          code="invalid_metadata")
    return meta


def items_of(body: Mapping[str, Any], required: bool) -> list[Any]:
    """The `items` a create adds: a list of at most 20 (checked one by one where they are stored)."""
    items = body.get("items")
    if items is None and not required:
        return []
    if not isinstance(items, list):
        raise bad_request("'items' must be an array of items.", param="items",
                          code="missing_required_parameter" if items is None else "invalid_type")
    if len(items) > MAX_ITEMS_PER_CALL:
        raise bad_request(f"'items' may hold at most {MAX_ITEMS_PER_CALL} items at a time.", param="items",
                          code="too_many_items")
    return items


def conversation_object(conversation_id: str, created_at: int, metadata: Mapping[str, str] | None) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation", "created_at": created_at, "metadata": dict(metadata or {})}


def deleted_object(conversation_id: str) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """A list page as OpenAI answers it: `limit` (1-100, default 20), `order` (`desc` by default), `after` an item
    id; `items` in ascending order (oldest first). An `after` that names no item of the list is a 400."""
    limit_s = query.get("limit", str(DEFAULT_PAGE))
    if not limit_s.isdigit() or not 1 <= int(limit_s) <= MAX_PAGE:
        raise bad_request(f"'limit' must be an integer from 1 to {MAX_PAGE}.", param="limit", code="invalid_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after:
        at = next((i for i, it in enumerate(ordered) if it.get("id") == after), None)
        if at is None:
            raise bad_request(f"'after' names no item of this list: '{after[:128]}'.", param="after",
                              code="invalid_value")
        ordered = ordered[at + 1:]
    n = int(limit_s)
    data = ordered[:n]
    return {"object": "list", "data": data, "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None, "has_more": len(ordered) > n}


class Conversations(Api):
    """A conversations route: a JSON body without a model on its POSTs, none on the others."""

    def parse(self, raw: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        return parse_json(raw) if raw.strip() else {}

    def ids(self, path: str) -> tuple[str, str]:
        """The conversation id and the item id ("" for none) the path names."""
        parts = path.split("/")
        return parts[3] if len(parts) > 3 else "", parts[5] if len(parts) > 5 else ""


CREATE: Final[Api] = Conversations("conversations", "/v1/conversations", state="conversations", local=True)
ONE: Final[Api] = Conversations("conversation", "/v1/conversations/{id}", methods=("GET", "POST", "DELETE"),
                                state="conversations", local=True)
ITEMS: Final[Api] = Conversations("conversation_items", "/v1/conversations/{id}/items", methods=("GET", "POST"),
                                  state="conversations", local=True)
ITEM: Final[Api] = Conversations("conversation_item", "/v1/conversations/{id}/items/{item}", methods=("GET", "DELETE"),
                                 body=NONE, state="conversations", local=True)


def now() -> int:
    return int(time.time())
