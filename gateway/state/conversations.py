"""The Conversations API served from the gateway's store: create, read, update and delete, and their items."""

from __future__ import annotations

from typing import Any, Mapping

import orjson

from gateway.apis import conversations as api
from gateway.config import ResponsesConfig
from gateway.errors import GatewayError, bad_request
from gateway.state.items import stored_items
from gateway.state.responses import item_of, unavailable
from gateway.state.store import CONVERSATION, FULL, MISSING, STORE_ERRORS, Store


def _full(cfg: ResponsesConfig) -> GatewayError:
    return GatewayError(400, f"The conversation would hold more than {cfg.max_conversation_items} items or "
                        f"{cfg.max_conversation_bytes} bytes, the most this gateway keeps in one; start another.",
                        param="items", code="conversation_full")


class ConversationsService:
    """Every conversations route; another key's conversation is the same 404 as an unknown one."""

    def __init__(self, store: Store, cfg: ResponsesConfig) -> None:
        self.store = store
        self.cfg = cfg

    async def answer(self, route: str, method: str, path: str, body: Mapping[str, Any], query: Mapping[str, str],
                     owner: str) -> bytes:
        """The JSON of a 200 for any conversations route (routes and methods checked by the caller)."""
        parts = path.split("/")
        cid = parts[3] if len(parts) > 3 else ""
        item = parts[5] if len(parts) > 5 else ""
        try:
            if route == api.CREATE.name:
                return await self._create(body, owner)
            meta = await self.store.get(CONVERSATION, owner, cid)
            if meta is None:
                raise api.not_found(cid)
            if route == api.ONE.name:
                return await self._one(method, cid, meta, body, owner)
            items = await self.store.items(owner, cid)
            if items is None:
                raise api.not_found(cid)
            if route == api.ITEMS.name:
                if method == "POST":
                    return await self._add(cid, body, owner)
                return orjson.dumps(api.page([i for i in map(item_of, items) if i is not None], query))
            return await self._item(method, cid, item, meta, items, owner)
        except STORE_ERRORS:
            raise unavailable("conversation") from None

    async def _create(self, body: Mapping[str, Any], owner: str) -> bytes:
        meta = api.metadata_of(body)
        items = [orjson.dumps(i) for i in stored_items(api.items_of(body, required=False), "items")]
        if sum(map(len, items)) > self.cfg.max_conversation_bytes:
            raise _full(self.cfg)
        cid, at = api.new_id(), api.now()
        record = {"id": cid, "created_at": at, "metadata": meta or {}}
        if not await self.store.create_conversation(owner, cid, orjson.dumps(record), items):
            raise GatewayError(409, f"This key holds {self.cfg.max_conversations_per_key} conversations, the most "
                               f"this gateway keeps for one key; delete some first.", code="too_many_conversations")
        return orjson.dumps(api.conversation_object(cid, at, meta))

    async def _one(self, method: str, cid: str, meta: bytes, body: Mapping[str, Any], owner: str) -> bytes:
        record = orjson.loads(meta)
        if method == "DELETE":
            await self.store.delete(CONVERSATION, owner, cid)
            return orjson.dumps(api.deleted_object(cid))
        if method == "POST":
            if "metadata" not in body:
                raise bad_request("Missing required parameter: 'metadata'.", param="metadata",
                                  code="missing_required_parameter")
            record["metadata"] = api.metadata_of(body) or {}
            if not await self.store.set_meta(owner, cid, orjson.dumps(record)):
                raise api.not_found(cid)
        return orjson.dumps(api.conversation_object(cid, record.get("created_at", 0), record.get("metadata")))

    async def _add(self, cid: str, body: Mapping[str, Any], owner: str) -> bytes:
        added = stored_items(api.items_of(body, required=True), "items")
        done = await self.store.append_items(owner, cid, [orjson.dumps(i) for i in added])
        if done == MISSING:
            raise api.not_found(cid)
        if done == FULL:
            raise _full(self.cfg)
        return orjson.dumps({"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
                             "last_id": added[-1]["id"] if added else None, "has_more": False})

    async def _item(self, method: str, cid: str, item_id: str, meta: bytes, items: list[bytes], owner: str) -> bytes:
        for raw in items:
            found = item_of(raw)
            if found is not None and found.get("id") == item_id:
                if method == "DELETE":
                    await self.store.delete_item(owner, cid, raw)
                    record = orjson.loads(meta)
                    return orjson.dumps(api.conversation_object(cid, record.get("created_at", 0),
                                                                record.get("metadata")))
                return orjson.dumps(found)
        raise api.item_not_found(item_id)
