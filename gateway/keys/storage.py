"""Where run-time API keys are kept: this process's memory, a private JSON file (atomic writes), or a Redis hash."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import orjson
import redis.asyncio as redis_asyncio
from pydantic import Field, ValidationError
from redis.exceptions import RedisError

from gateway.config import ApiKey, StateConfig
from gateway.keys.private_file import (PrivateFileError, check_private_place, open_lock, private_path, read_private,
                                       write_private)

log = logging.getLogger("shapegate.keys")

# Ids of keys made at run time: they show in logs, metrics and URLs (DELETE /admin/keys/{id}).
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
# Run-time keys a store takes at most: each is loaded by every process and listed whole by GET /admin/keys.
MAX_RUNTIME_KEYS = 10_000

Records = dict[str, "KeyRecord"]


class KeyRecord(ApiKey):
    """One run-time key as stored: its id, digest, admin flag, limits and when it was made; never the key."""

    id: str = Field(pattern=ID_PATTERN)
    created: float


class KeyExists(Exception):
    """A key with this id exists already."""


class KeyNotFound(Exception):
    """No run-time key has this id."""


class StoreUnavailable(Exception):
    """The store could not be read or changed; nothing was changed (the message is for the log)."""


class TooManyKeys(Exception):
    """The store holds MAX_RUNTIME_KEYS run-time keys already; nothing was changed."""


class KeyBackend(Protocol):
    kind: str  # "memory" | "file" | "redis"

    async def poll(self) -> Records | None:
        """Every key, when the stored set may have changed since the last poll; None when it has not."""

    async def add(self, rec: KeyRecord) -> Records | None:
        """Store a new key (KeyExists if its id is taken); the whole set if it was read on the way, else None."""

    async def remove(self, key_id: str) -> Records | None:
        """Remove a key (KeyNotFound if there is none); the whole set if it was read on the way, else None."""

    async def publish_used(self, used: dict[str, float]) -> None:
        """When keys were last used here, merged with what other processes published (the latest wins)."""

    async def read_used(self) -> dict[str, float]: ...

    async def close(self) -> None: ...


class MemoryKeys:
    """Keys of this process only: lost when it stops."""

    kind = "memory"

    def __init__(self) -> None:
        self._records: Records = {}

    async def poll(self) -> Records | None:
        return None  # nobody else changes them

    async def add(self, rec: KeyRecord) -> Records | None:
        if rec.id in self._records:
            raise KeyExists(rec.id)
        if len(self._records) >= MAX_RUNTIME_KEYS:
            raise TooManyKeys()
        self._records[rec.id] = rec
        return dict(self._records)

    async def remove(self, key_id: str) -> Records | None:
        if self._records.pop(key_id, None) is None:
            raise KeyNotFound(key_id)
        return dict(self._records)

    async def publish_used(self, used: dict[str, float]) -> None:
        return None

    async def read_used(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


def _parse_records(data: bytes) -> Records:
    """The keys of a keys file; StoreUnavailable (naming the problem, never a digest) when it is not one."""
    try:
        doc = orjson.loads(data) if data.strip() else {"keys": []}
        rows = doc["keys"]
        records = [KeyRecord.model_validate(r) for r in rows]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValidationError) as e:
        where = f" (at {'.'.join(map(str, e.errors()[0]['loc']))})" if isinstance(e, ValidationError) else ""
        raise StoreUnavailable(f"not a keys file{where}: {type(e).__name__}") from None
    return {r.id: r for r in records}


class FileKeys:
    """A JSON file that every process of a host reads; each change is made under an exclusive lock and
    written aside, synced and renamed into place, so a reader sees the old file or the new one whole.

    The file decides who may use the gateway, so its place must be one no other local user can change: the
    directory is checked at start (gateway/keys/private_file.py has the rule), every file is opened never
    through a link, and each write goes to a fresh unpredictable name made exclusively (0600).
    """

    kind = "file"

    def __init__(self, path: str, what: str = "[auth] keys_file") -> None:
        self.path = private_path(path)
        self.used_path = self.path + ".used"
        self._lock_path = self.path + ".lock"
        check_private_place(self.path, what, (self._lock_path, self.used_path))  # UnsafePlace: a ValueError
        self._seen: tuple | None = None  # (inode, size, mtime) of the file last read

    def _signature(self) -> tuple:
        try:
            st = os.lstat(self.path)  # the name itself: a link put there is noticed (and refused), never looked through
        except FileNotFoundError:
            return ()
        except OSError as e:
            raise StoreUnavailable(f"cannot read {self.path}: {e.strerror}") from None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> tuple[Records, tuple, int]:
        """(the keys, the file's signature, its mtime in ns) of exactly the version that was read."""
        try:
            got = read_private(self.path)
        except PrivateFileError as e:
            raise StoreUnavailable(str(e)) from None
        if got is None:
            return {}, (), 0
        data, st = got
        return _parse_records(data), (st.st_ino, st.st_size, st.st_mtime_ns), st.st_mtime_ns

    async def poll(self) -> Records | None:
        # One stat per poll, on the loop: microseconds, unlike reading and parsing, which go to a thread.
        if self._signature() == self._seen:
            return None
        try:
            records, sig, _ = await asyncio.to_thread(self._read)
        except StoreUnavailable:
            self._seen = self._signature()  # reported once; read again when the file changes
            raise
        self._seen = sig
        return records

    def _lock(self) -> int:
        try:
            lock = open_lock(self._lock_path)
        except PrivateFileError as e:
            raise StoreUnavailable(str(e)) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:
            os.close(lock)
            raise StoreUnavailable(f"cannot lock {self._lock_path}: {e.strerror}") from None
        return lock

    def _locked(self, change: Callable[[Records], Records]) -> Records:
        """Read the file as it is now, apply `change`, write the result; all under the lock (in a thread)."""
        lock = self._lock()
        try:
            records, _, mtime_ns = self._read()
            records = change(records)
            rows = [r.model_dump(mode="json") for r in sorted(records.values(), key=lambda r: r.created)]
            # A strictly later mtime than the file it replaces: a reader comparing (inode, size, mtime) sees
            # every change even if the new file reuses the old inode and size within one clock tick.
            write_private(self.path, orjson.dumps({"keys": rows}, option=orjson.OPT_INDENT_2),
                          mtime_ns=max(time.time_ns(), mtime_ns + 1_000_000))
            return records
        except PrivateFileError as e:
            raise StoreUnavailable(str(e)) from None
        finally:
            os.close(lock)  # releases the lock

    async def add(self, rec: KeyRecord) -> Records | None:
        def change(records: Records) -> Records:
            if rec.id in records:
                raise KeyExists(rec.id)
            if len(records) >= MAX_RUNTIME_KEYS:
                raise TooManyKeys()
            return {**records, rec.id: rec}

        return await asyncio.to_thread(self._locked, change)

    async def remove(self, key_id: str) -> Records | None:
        def change(records: Records) -> Records:
            if key_id not in records:
                raise KeyNotFound(key_id)
            return {k: r for k, r in records.items() if k != key_id}

        return await asyncio.to_thread(self._locked, change)

    def _merge_used(self, used: dict[str, float]) -> None:
        lock = self._lock()
        try:
            merged = self._read_used()
            for k, t in used.items():
                merged[k] = max(t, merged.get(k, 0.0))
            write_private(self.used_path, orjson.dumps(merged), sync=False)  # approximate figures: no fsync
        except PrivateFileError as e:
            raise StoreUnavailable(str(e)) from None
        finally:
            os.close(lock)

    def _read_used(self) -> dict[str, float]:
        try:
            got = read_private(self.used_path)
            data = orjson.loads(got[0]) if got is not None else {}
        except (PrivateFileError, orjson.JSONDecodeError):
            return {}
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}

    async def publish_used(self, used: dict[str, float]) -> None:
        try:
            await asyncio.to_thread(self._merge_used, used)
        except OSError as e:
            raise StoreUnavailable(f"cannot write {self.used_path}: {e.strerror}") from None

    async def read_used(self) -> dict[str, float]:
        return await asyncio.to_thread(self._read_used)

    async def close(self) -> None:
        return None


# Both change the hash and bump the version in one step, so a replica that sees the version sees the change.
# _ADD: 1 added, 0 the id is taken, -1 the store is full (ARGV[3]: MAX_RUNTIME_KEYS).
_ADD = """if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[2])
return 1"""
# By id, not only by field name: a record is listed under the id it holds, and one stored under another field
# (written by hand, or by another tool) must be revocable too. Every field holding the id goes; the scan is
# over at most MAX_RUNTIME_KEYS records, on a rare admin action.
_REMOVE = """local n = redis.call('HDEL', KEYS[1], ARGV[1])
local rows = redis.call('HGETALL', KEYS[1])
for i = 1, #rows, 2 do
  local ok, rec = pcall(cjson.decode, rows[i + 1])
  if ok and type(rec) == 'table' and rec['id'] == ARGV[1] then
    n = n + redis.call('HDEL', KEYS[1], rows[i])
  end
end
if n == 0 then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('INCR', KEYS[2])
return n"""
_NEVER = object()


class RedisKeys:
    """`<prefix>keys` (id -> JSON record), `<prefix>keys:version` (bumped on every change) and
    `<prefix>keys:used` (id -> last use, a sorted set that only moves forward)."""

    kind = "redis"

    def __init__(self, cfg: StateConfig) -> None:
        self.timeout = cfg.redis_timeout_s
        self.client = redis_asyncio.Redis.from_url(cfg.redis_url, socket_timeout=self.timeout,
                                                   socket_connect_timeout=self.timeout)
        p = cfg.key_prefix
        self.keys = (p + "keys", p + "keys:version", p + "keys:used")
        self._seen: object = _NEVER  # the version last loaded
        self._parsed: dict[bytes, KeyRecord] = {}  # records as stored -> parsed: a reload parses only new ones

    async def _call(self, coro):
        try:
            async with asyncio.timeout(self.timeout):
                return await coro
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(f"Redis: {type(e).__name__}: {e}") from None

    async def poll(self) -> Records | None:
        if await self._call(self.client.get(self.keys[1])) == self._seen:
            return None
        async with self.client.pipeline(transaction=True) as p:
            p.get(self.keys[1])
            p.hgetall(self.keys[0])
            version, rows = await self._call(p.execute())
        parsed: dict[bytes, KeyRecord] = {}
        records: Records = {}
        for name, raw in sorted(rows.items()):
            rec = self._parsed.get(raw)
            if rec is None:
                try:
                    rec = KeyRecord.model_validate_json(raw)
                except ValidationError:
                    log.warning("run-time key %r in Redis is not a valid record: left out", name[:64])
                    continue
            parsed[raw] = rec
            # One record per id, the same on every replica: the one stored under its own id wins.
            if rec.id not in records or name == rec.id.encode():
                records[rec.id] = rec
        self._parsed, self._seen = parsed, version
        return records

    async def add(self, rec: KeyRecord) -> Records | None:
        raw = orjson.dumps(rec.model_dump(mode="json"))
        added = await self._call(self.client.eval(_ADD, 2, *self.keys[:2], rec.id, raw, MAX_RUNTIME_KEYS))
        if added == 0:
            raise KeyExists(rec.id)
        if added < 0:
            raise TooManyKeys()
        return None

    async def remove(self, key_id: str) -> Records | None:
        if not await self._call(self.client.eval(_REMOVE, 3, *self.keys, key_id)):
            raise KeyNotFound(key_id)
        return None

    async def publish_used(self, used: dict[str, float]) -> None:
        if used:
            await self._call(self.client.zadd(self.keys[2], used, gt=True))

    async def read_used(self) -> dict[str, float]:
        rows = await self._call(self.client.zrange(self.keys[2], 0, -1, withscores=True))
        return {(k.decode() if isinstance(k, bytes) else k): float(t) for k, t in rows}

    async def close(self) -> None:
        await self.client.aclose()
