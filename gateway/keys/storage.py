"""Where run-time API keys are kept: this process's memory, a JSON file (atomic writes), or a Redis hash."""

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

log = logging.getLogger("shapegate.keys")

# Ids of keys made at run time: they show in logs, metrics and URLs (DELETE /admin/keys/{id}).
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"

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
    written aside, synced and renamed into place, so a reader sees the old file or the new one whole."""

    kind = "file"

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.used_path = self.path + ".used"
        self._lock_path = self.path + ".lock"
        self._seen: tuple | None = None  # (inode, size, mtime) of the file last read

    def _signature(self) -> tuple:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return ()
        except OSError as e:
            raise StoreUnavailable(f"cannot read {self.path}: {e.strerror}") from None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> tuple[Records, tuple, int]:
        """(the keys, the file's signature, its mtime in ns) of exactly the version that was read."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return {}, (), 0
        except OSError as e:
            raise StoreUnavailable(f"cannot read {self.path}: {e.strerror}") from None
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

    def _locked(self, change: Callable[[Records], Records]) -> Records:
        """Read the file as it is now, apply `change`, write the result; all under the lock (in a thread)."""
        try:
            lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StoreUnavailable(f"cannot open {self._lock_path}: {e.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            records, _, mtime_ns = self._read()
            records = change(records)
            rows = [r.model_dump(mode="json") for r in sorted(records.values(), key=lambda r: r.created)]
            # A strictly later mtime than the file it replaces: a reader comparing (inode, size, mtime) sees
            # every change even if the new file reuses the old inode and size within one clock tick.
            write_atomic(self.path, orjson.dumps({"keys": rows}, option=orjson.OPT_INDENT_2),
                         mtime_ns=max(time.time_ns(), mtime_ns + 1_000_000))
            return records
        finally:
            os.close(lock)  # releases the lock

    async def add(self, rec: KeyRecord) -> Records | None:
        def change(records: Records) -> Records:
            if rec.id in records:
                raise KeyExists(rec.id)
            return {**records, rec.id: rec}

        return await asyncio.to_thread(self._locked, change)

    async def remove(self, key_id: str) -> Records | None:
        def change(records: Records) -> Records:
            if key_id not in records:
                raise KeyNotFound(key_id)
            return {k: r for k, r in records.items() if k != key_id}

        return await asyncio.to_thread(self._locked, change)

    def _merge_used(self, used: dict[str, float]) -> None:
        lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = self._read_used()
            for k, t in used.items():
                merged[k] = max(t, merged.get(k, 0.0))
            write_atomic(self.used_path, orjson.dumps(merged), sync=False)  # approximate figures: no fsync
        finally:
            os.close(lock)

    def _read_used(self) -> dict[str, float]:
        try:
            with open(self.used_path, "rb") as f:
                data = orjson.loads(f.read())
        except (OSError, orjson.JSONDecodeError):
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


def write_atomic(path: str, payload: bytes, *, sync: bool = True, mtime_ns: int | None = None) -> None:
    """Replace `path` whole: write a file beside it (owner-only), fsync it, rename it over, fsync the directory."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
        if sync:
            d = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
            try:
                os.fsync(d)  # the rename itself survives a crash
            finally:
                os.close(d)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise StoreUnavailable(f"cannot write {path}: {e.strerror}") from None


# Both change the hash and bump the version in one step, so a replica that sees the version sees the change.
_ADD = """if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('INCR', KEYS[2])
return 1"""
_REMOVE = """if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('INCR', KEYS[2])
return 1"""
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
        for name, raw in rows.items():
            rec = self._parsed.get(raw)
            if rec is None:
                try:
                    rec = KeyRecord.model_validate_json(raw)
                except ValidationError:
                    log.warning("run-time key %r in Redis is not a valid record: left out", name[:64])
                    continue
            parsed[raw] = rec
        self._parsed, self._seen = parsed, version
        return {r.id: r for r in parsed.values()}

    async def add(self, rec: KeyRecord) -> Records | None:
        raw = orjson.dumps(rec.model_dump(mode="json"))
        if not await self._call(self.client.eval(_ADD, 2, *self.keys[:2], rec.id, raw)):
            raise KeyExists(rec.id)
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
