"""The store of gateway/state/store.py in Redis, shared by every worker and replica: each write is one atomic script.

Keys (under [state] key_prefix): `resp:{owner}:{id}` a stored response (with its TTL); `respidx:{owner}` the key's
response ids by write time and `respsize:{owner}` their sizes (field `*`: the total), and `respidx` / `respsize`
the same for all keys, which the bounds are kept by; `conv:{owner}:{id}` a conversation (a hash: its metadata, its
item count and bytes), `convitems:{owner}:{id}` its items (a list), `convidx:{owner}` the key's conversations.
An index entry whose record expired is dropped, with its size, the next time the index is written.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Final

import redis.asyncio as redis_asyncio

from gateway.config import ResponsesConfig, StateConfig
from gateway.limits.resp import RespConnection, RespError
from gateway.state.store import CONVERSATION, FULL, MISSING, OK, RESPONSE

# KEYS: record, owner index, owner sizes, all index, all sizes. ARGV: id, data, ttl_ms, (unused), max per key,
# max bytes per key, max in all, max bytes in all, owner, record prefix ("<prefix>resp:"), statuses ("" or a list
# of statuses separated by spaces: replace only a record whose status is one of them).
_PUT: Final = """
local rec, oidx, osize, aidx, asize = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, data, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
-- The indexes' scores: the server's clock in microseconds, so that writes keep their order (one script at a time)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local maxn, maxb, maxan, maxab = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local owner, prefix, statuses = ARGV[9], ARGV[10], ARGV[11]
if statuses ~= "" then
  local cur = redis.call('GET', rec)
  if not cur then return -1 end
  local st = string.match(string.sub(cur, 1, 64), '"status":"([%w_]+)"')
  if not st or not string.find(' ' .. statuses .. ' ', ' ' .. st .. ' ', 1, true) then return -1 end
end
local function drop_owned(o, rid)
  local okey, skey = prefix .. 'idx:' .. o, prefix .. 'size:' .. o
  local size = tonumber(redis.call('HGET', skey, rid) or '0')
  redis.call('ZREM', okey, rid)
  redis.call('HDEL', skey, rid)
  redis.call('HINCRBY', skey, '*', 0 - size)
  redis.call('ZREM', aidx, o .. '\\n' .. rid)
  redis.call('HDEL', asize, o .. '\\n' .. rid)
  redis.call('HINCRBY', asize, '*', 0 - size)
  redis.call('DEL', prefix .. ':' .. o .. ':' .. rid)
end
local function expire_old(idx, is_all)
  local old = redis.call('ZRANGEBYSCORE', idx, '-inf', now - ttl * 1000, 'LIMIT', 0, 64)
  for _, m in ipairs(old) do
    if is_all then
      local nl = string.find(m, '\\n', 1, true)
      drop_owned(string.sub(m, 1, nl - 1), string.sub(m, nl + 1))
    else
      drop_owned(owner, m)
    end
  end
end
expire_old(oidx, false)
expire_old(aidx, true)
drop_owned(owner, id)
redis.call('SET', rec, data, 'PX', ttl)
local size = string.len(data)
redis.call('ZADD', oidx, now, id)
redis.call('HSET', osize, id, size)
redis.call('HINCRBY', osize, '*', size)
redis.call('ZADD', aidx, now, owner .. '\\n' .. id)
redis.call('HSET', asize, owner .. '\\n' .. id, size)
redis.call('HINCRBY', asize, '*', size)
local evicted = 0
while redis.call('ZCARD', oidx) > maxn or tonumber(redis.call('HGET', osize, '*') or '0') > maxb do
  local oldest = redis.call('ZRANGE', oidx, 0, 0)[1]
  if oldest == id then break end
  drop_owned(owner, oldest)
  evicted = evicted + 1
end
while redis.call('ZCARD', aidx) > maxan or tonumber(redis.call('HGET', asize, '*') or '0') > maxab do
  local m = redis.call('ZRANGE', aidx, 0, 0)[1]
  if m == owner .. '\\n' .. id then break end
  local nl = string.find(m, '\\n', 1, true)
  drop_owned(string.sub(m, 1, nl - 1), string.sub(m, nl + 1))
  evicted = evicted + 1
end
redis.call('PEXPIRE', oidx, ttl)
redis.call('PEXPIRE', osize, ttl)
return evicted
"""

# KEYS: record, owner index, owner sizes, all index, all sizes. ARGV: id, owner.
_DELETE: Final = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[3], '*', 0 - size)
redis.call('ZREM', KEYS[4], ARGV[2] .. '\\n' .. ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[2] .. '\\n' .. ARGV[1])
redis.call('HINCRBY', KEYS[5], '*', 0 - size)
return 1
"""

# KEYS: conversation, its items, the owner's conversations. ARGV: id, meta, ttl_ms, now_ms, max per key, items...
_CREATE_CONVERSATION: Final = """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', tonumber(ARGV[4]) - tonumber(ARGV[3]))
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[5]) then return 0 end
local size = 0
for i = 6, #ARGV do
  redis.call('RPUSH', KEYS[2], ARGV[i])
  size = size + string.len(ARGV[i])
end
redis.call('HSET', KEYS[1], 'meta', ARGV[2], 'n', #ARGV - 5, 'bytes', size)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if #ARGV > 5 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return 1
"""

# KEYS: conversation, its items, the owner's conversations. ARGV: id, ttl_ms, now_ms, max items, max bytes, items...
_APPEND: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
local size = 0
for i = 6, #ARGV do size = size + string.len(ARGV[i]) end
if n + #ARGV - 5 > tonumber(ARGV[4]) or bytes + size > tonumber(ARGV[5]) then return 'full' end
for i = 6, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HINCRBY', KEYS[1], 'n', #ARGV - 5)
redis.call('HINCRBY', KEYS[1], 'bytes', size)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 'ok'
"""

# KEYS: conversation, its items, the owner's conversations. ARGV: id, meta, ttl_ms, now_ms.
_SET_META: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'meta', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return 1
"""

# KEYS: conversation, its items. ARGV: the item as stored.
_DELETE_ITEM: Final = """
if redis.call('LREM', KEYS[2], 1, ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'n', -1)
redis.call('HINCRBY', KEYS[1], 'bytes', -string.len(ARGV[1]))
return 1
"""

# KEYS: conversation, its items, the owner's conversations. ARGV: id.
_DELETE_CONVERSATION: Final = """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[2])
return redis.call('DEL', KEYS[1])
"""


class RedisStore:
    """The store in Redis (see the module's docstring). Every call is bounded by [responses] store_timeout_s; a Redis
    that does not answer raises (redis.exceptions.RedisError, OSError, TimeoutError) for the caller to judge.

    The reads and the scripts a turn waits on (a record, a chain's records, whether they still exist; the record's
    write) go over one pipelined connection of the request path's own (gateway/limits/resp.py: a few
    microseconds of CPU each); a conversation's items are read through redis-py."""

    kind = "redis"

    def __init__(self, cfg: ResponsesConfig, state: StateConfig) -> None:
        self.cfg = cfg
        self.prefix = state.key_prefix
        self.url = state.redis_url
        self._wire: RespConnection | None = None
        self._opening = asyncio.Lock()
        self.client = redis_asyncio.Redis.from_url(state.redis_url, socket_timeout=cfg.store_timeout_s,
                                                   socket_connect_timeout=cfg.store_timeout_s)
        self._put = self._script(_PUT)
        self._delete = self._script(_DELETE)
        self._create_conv = self._script(_CREATE_CONVERSATION)
        self._append = self._script(_APPEND)
        self._set_meta = self._script(_SET_META)
        self._delete_item = self._script(_DELETE_ITEM)
        self._delete_conv = self._script(_DELETE_CONVERSATION)

    def _key(self, kind: str, owner: str, oid: str) -> str:
        return f"{self.prefix}{kind}:{owner}:{oid}"

    def _response_keys(self, owner: str, rid: str) -> list[str]:
        p = self.prefix
        return [self._key(RESPONSE, owner, rid), f"{p}respidx:{owner}", f"{p}respsize:{owner}", f"{p}respidx",
                f"{p}respsize"]

    def _conversation_keys(self, owner: str, cid: str) -> list[str]:
        return [self._key(CONVERSATION, owner, cid), f"{self.prefix}convitems:{owner}:{cid}",
                f"{self.prefix}convidx:{owner}"]

    def _ms(self) -> tuple[int, int]:
        return int(self.cfg.ttl_s * 1000), int(time.time() * 1000)

    async def _read(self, *args: Any) -> Any:
        """One read on the request path's connection (opened, or opened again, on first need)."""
        async with asyncio.timeout(self.cfg.store_timeout_s):
            wire = self._wire
            if wire is None or not wire.is_open:
                async with self._opening:
                    wire = self._wire
                    if wire is None or not wire.is_open:
                        wire = self._wire = await RespConnection.open(self.url)
            return await wire.call(*args)

    def _script(self, source: str) -> Script:
        return Script(self, source)

    async def get(self, kind: str, owner: str, oid: str) -> bytes | None:
        if kind == RESPONSE:
            data: Any = await self._read("GET", self._key(kind, owner, oid))
        else:
            data = await self._read("HGET", self._key(kind, owner, oid), "meta")
        return data if isinstance(data, bytes) else None

    async def get_many(self, kind: str, owner: str, oids: list[str]) -> list[bytes | None]:
        if not oids:
            return []
        assert kind == RESPONSE  # (conversations are read one at a time)
        found = await self._read("MGET", *(self._key(kind, owner, o) for o in oids))
        return [v if isinstance(v, bytes) else None for v in found]

    async def count(self, kind: str, owner: str, oids: list[str]) -> int:
        if not oids:
            return 0
        return int(await self._read("EXISTS", *(self._key(kind, owner, o) for o in oids)))

    async def put_response(self, owner: str, rid: str, data: bytes) -> int:
        return max(int(await self._run_put(owner, rid, data, "")), 0)

    async def replace_response_if(self, owner: str, rid: str, data: bytes, status_from: tuple[str, ...]) -> bool:
        return int(await self._run_put(owner, rid, data, " ".join(status_from))) >= 0

    async def _run_put(self, owner: str, rid: str, data: bytes, statuses: str) -> Any:
        ttl, now = self._ms()
        c = self.cfg
        return await self._put(keys=self._response_keys(owner, rid),
                               args=[rid, data, ttl, now, c.max_per_key, c.max_bytes_per_key, c.max_total,
                                     c.max_total_bytes, owner, self.prefix + "resp", statuses])

    async def delete(self, kind: str, owner: str, oid: str) -> bool:
        if kind == RESPONSE:
            return int(await self._delete(keys=self._response_keys(owner, oid), args=[oid, owner])) == 1
        return int(await self._delete_conv(keys=self._conversation_keys(owner, oid), args=[oid])) == 1

    async def create_conversation(self, owner: str, cid: str, meta: bytes, items: list[bytes]) -> bool:
        ttl, now = self._ms()
        done = await self._create_conv(keys=self._conversation_keys(owner, cid),
                                       args=[cid, meta, ttl, now, self.cfg.max_conversations_per_key, *items])
        return int(done) == 1

    async def set_meta(self, owner: str, cid: str, meta: bytes) -> bool:
        ttl, now = self._ms()
        return int(await self._set_meta(keys=self._conversation_keys(owner, cid), args=[cid, meta, ttl, now])) == 1

    async def items(self, owner: str, cid: str) -> list[bytes] | None:
        keys = self._conversation_keys(owner, cid)
        async with self.client.pipeline(transaction=True) as p:
            p.exists(keys[0])
            p.lrange(keys[1], 0, self.cfg.max_conversation_items)
            found, items = await p.execute()
        return [i for i in items if isinstance(i, bytes)] if found else None

    async def append_items(self, owner: str, cid: str, items: list[bytes]) -> str:
        ttl, now = self._ms()
        c = self.cfg
        done = await self._append(keys=self._conversation_keys(owner, cid),
                                  args=[cid, ttl, now, c.max_conversation_items, c.max_conversation_bytes, *items])
        word = done.decode() if isinstance(done, bytes) else str(done)
        return word if word in (OK, MISSING, FULL) else MISSING

    async def delete_item(self, owner: str, cid: str, item: bytes) -> bool:
        keys = self._conversation_keys(owner, cid)
        return int(await self._delete_item(keys=keys[:2], args=[item])) == 1

    async def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        await self.client.aclose()


class Script:
    """A Lua script run by its digest on the store's connection, loaded again when Redis does not know it (a
    restart, a SCRIPT FLUSH)."""

    def __init__(self, store: RedisStore, source: str) -> None:
        self.store = store
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.store._read("EVALSHA", self.sha, len(keys), *keys, *args)
        except RespError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        await self.store._read("SCRIPT", "LOAD", self.source)
        return await self.store._read("EVALSHA", self.sha, len(keys), *keys, *args)
