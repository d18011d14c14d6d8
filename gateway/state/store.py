"""The store of the state the gateway keeps for clients (stored responses, conversations): its contract, and the
implementation in this process's memory. gateway/state/redis_store.py is the one replicas share.

Everything is kept under its owner: a record's key holds the owning key's identity, so that another key's id is
the same miss as an unknown one (one lookup either way: no answer and no timing tells them apart), and a key
re-created under a revoked key's id (another identity) finds nothing of the old one's.

Values are opaque bytes (JSON the services in gateway/state/ make and read). Bounds: per stored response, per
key (count and bytes: the key's oldest go first) and in all (the oldest of all go first); conversations per key
and items per conversation are refused past their bounds rather than dropped, so no history is ever silently cut.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Final, Protocol

from redis.exceptions import RedisError

from gateway.config import ResponsesConfig
from gateway.limits.resp import RespError

RESPONSE: Final = "resp"
CONVERSATION: Final = "conv"

# What a store that does not answer raises (the Redis store; the memory store raises none).
STORE_ERRORS: Final = (RedisError, RespError, OSError, TimeoutError)

# What a conversation write can come to.
OK: Final = "ok"
MISSING: Final = "missing"  # no such conversation (or another key's)
FULL: Final = "full"  # past max_conversation_items or max_conversation_bytes


class Store(Protocol):
    """What the services need of a store; MemoryStore and RedisStore are the two."""

    kind: str  # "memory" | "redis"

    async def get(self, kind: str, owner: str, oid: str) -> bytes | None: ...

    async def get_many(self, kind: str, owner: str, oids: list[str]) -> list[bytes | None]: ...

    async def count(self, kind: str, owner: str, oids: list[str]) -> int:
        """How many of these exist."""

    async def put_response(self, owner: str, rid: str, data: bytes) -> int:
        """Keep (or replace) a response; how many others were evicted to make room."""

    async def replace_response_if(self, owner: str, rid: str, data: bytes, status_from: tuple[str, ...]) -> bool:
        """Replace a response whose status is one of `status_from` (a background run's progress, a cancel)."""

    async def delete(self, kind: str, owner: str, oid: str) -> bool: ...

    async def create_conversation(self, owner: str, cid: str, meta: bytes, items: list[bytes]) -> bool:
        """False when the key holds max_conversations_per_key already (nothing made)."""

    async def set_meta(self, owner: str, cid: str, meta: bytes) -> bool: ...

    async def items(self, owner: str, cid: str) -> list[bytes] | None:
        """A conversation's items, oldest first; None: no such conversation."""

    async def append_items(self, owner: str, cid: str, items: list[bytes]) -> str: ...

    async def delete_item(self, owner: str, cid: str, item: bytes) -> bool: ...

    async def close(self) -> None: ...


def status_of(data: bytes) -> str:
    """A stored response's status: records start with it (`{"status":"...",`), so it is read without parsing."""
    head = data[:64]
    i = head.find(b'"status":"')
    if i < 0:
        return ""
    j = head.find(b'"', i + 10)
    return head[i + 10:j].decode("ascii", "replace") if j > 0 else ""


class _Conversation:
    __slots__ = ("meta", "items", "size", "expires")

    def __init__(self, meta: bytes, items: list[bytes], expires: float) -> None:
        self.meta = meta
        self.items = items
        self.size = sum(map(len, items))
        self.expires = expires


class MemoryStore:
    """The store in this process: what one gateway process (or one worker) keeps."""

    kind = "memory"

    def __init__(self, cfg: ResponsesConfig) -> None:
        self.cfg = cfg
        # (owner, id) -> (data, expires): least recently written first; per owner its ids, oldest first, and sizes.
        self._responses: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._by_owner: dict[str, OrderedDict[str, int]] = {}
        self._owner_bytes: dict[str, int] = {}
        self._bytes = 0
        self._conversations: dict[tuple[str, str], _Conversation] = {}

    # -- responses -------------------------------------------------------------------------------------------------
    def _live(self, key: tuple[str, str]) -> bytes | None:
        entry = self._responses.get(key)
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            self._drop(*key)
            return None
        return entry[0]

    async def get(self, kind: str, owner: str, oid: str) -> bytes | None:
        if kind == RESPONSE:
            return self._live((owner, oid))
        conv = self._conversation(owner, oid)
        return conv.meta if conv is not None else None

    async def get_many(self, kind: str, owner: str, oids: list[str]) -> list[bytes | None]:
        return [await self.get(kind, owner, o) for o in oids]

    async def count(self, kind: str, owner: str, oids: list[str]) -> int:
        return sum(1 for v in await self.get_many(kind, owner, oids) if v is not None)

    async def put_response(self, owner: str, rid: str, data: bytes) -> int:
        cfg = self.cfg
        self._drop(owner, rid)
        self._responses[(owner, rid)] = (data, time.monotonic() + cfg.ttl_s)
        mine = self._by_owner.setdefault(owner, OrderedDict())
        mine[rid] = len(data)
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + len(data)
        self._bytes += len(data)
        evicted = 0
        while len(mine) > cfg.max_per_key or self._owner_bytes[owner] > cfg.max_bytes_per_key:
            oldest = next(iter(mine))
            if oldest == rid:
                break  # the one just written stays: its own size was checked against max_response_bytes
            self._drop(owner, oldest)
            evicted += 1
        while len(self._responses) > cfg.max_total or self._bytes > cfg.max_total_bytes:
            key = next(iter(self._responses))
            if key == (owner, rid):
                break
            self._drop(*key)
            evicted += 1
        return evicted

    async def replace_response_if(self, owner: str, rid: str, data: bytes, status_from: tuple[str, ...]) -> bool:
        now = self._live((owner, rid))
        if now is None or status_of(now) not in status_from:
            return False
        await self.put_response(owner, rid, data)
        return True

    def _drop(self, owner: str, rid: str) -> bool:
        if self._responses.pop((owner, rid), None) is None:
            return False
        mine = self._by_owner.get(owner)
        size = mine.pop(rid, 0) if mine is not None else 0
        self._bytes -= size
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) - size
        if mine is not None and not mine:
            del self._by_owner[owner]
            self._owner_bytes.pop(owner, None)
        return True

    async def delete(self, kind: str, owner: str, oid: str) -> bool:
        if kind == RESPONSE:
            return self._drop(owner, oid)
        return self._conversations.pop((owner, oid), None) is not None

    # -- conversations ---------------------------------------------------------------------------------------------
    def _conversation(self, owner: str, cid: str) -> _Conversation | None:
        conv = self._conversations.get((owner, cid))
        if conv is not None and conv.expires < time.monotonic():
            del self._conversations[(owner, cid)]
            return None
        return conv

    async def create_conversation(self, owner: str, cid: str, meta: bytes, items: list[bytes]) -> bool:
        now = time.monotonic()
        mine = [k for k, c in self._conversations.items() if k[0] == owner and c.expires >= now]
        if len(mine) >= self.cfg.max_conversations_per_key:
            return False
        self._conversations[(owner, cid)] = _Conversation(meta, list(items), now + self.cfg.ttl_s)
        return True

    async def set_meta(self, owner: str, cid: str, meta: bytes) -> bool:
        conv = self._conversation(owner, cid)
        if conv is None:
            return False
        conv.meta, conv.expires = meta, time.monotonic() + self.cfg.ttl_s
        return True

    async def items(self, owner: str, cid: str) -> list[bytes] | None:
        conv = self._conversation(owner, cid)
        return list(conv.items) if conv is not None else None

    async def append_items(self, owner: str, cid: str, items: list[bytes]) -> str:
        conv = self._conversation(owner, cid)
        if conv is None:
            return MISSING
        size = sum(map(len, items))
        if len(conv.items) + len(items) > self.cfg.max_conversation_items or \
                conv.size + size > self.cfg.max_conversation_bytes:
            return FULL
        conv.items += items
        conv.size += size
        conv.expires = time.monotonic() + self.cfg.ttl_s
        return OK

    async def delete_item(self, owner: str, cid: str, item: bytes) -> bool:
        conv = self._conversation(owner, cid)
        if conv is None or item not in conv.items:
            return False
        conv.items.remove(item)
        conv.size -= len(item)
        return True

    async def close(self) -> None:
        return None
