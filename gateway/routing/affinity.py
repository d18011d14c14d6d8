"""Routing state shared by replicas: the prefix/session affinity index and the stores behind it (memory, Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict, deque
from typing import Callable, Final, Iterable, Protocol

import orjson
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.contracts import RequestShape
from gateway.routing.shape import CHARS_PER_TOKEN, session_key

log = logging.getLogger("shapegate.state")

Clock = Callable[[], float]

ORD_BITS: Final = 12  # backend ordinal in the low bits of an index value; the expiry (ms) above it
ORD_MASK: Final = (1 << ORD_BITS) - 1
MAX_BACKENDS: Final = ORD_MASK + 1
AFFINITY_CHANNEL: Final = "affinity"


class StoreError(Exception):
    """The shared store failed or timed out; callers keep their local state."""


class StateStore(Protocol):
    """A bounded, expiring log per channel that every replica appends to and reads from.

    Cursors are "<ms>-<seq>" strings that grow with time, so a reader can skip entries older than a TTL.
    """

    async def append(self, channel: str, payload: bytes) -> str: ...

    async def read(self, channel: str, after: str, limit: int) -> list[tuple[str, bytes]]: ...

    async def close(self) -> None: ...


def cursor_ms(cursor: str) -> int:
    return int(cursor.split("-", 1)[0])


class MemoryStore:
    """The store of a single process (and the reference the Redis store is tested against)."""

    def __init__(self, max_entries: int = 10_000, clock: Clock = time.time) -> None:
        self._logs: dict[str, deque[tuple[str, bytes]]] = {}
        self._max = max_entries
        self._clock = clock
        self._last = (0, 0)
        self.closed = False

    def _next_id(self) -> str:
        ms = int(self._clock() * 1000)
        last_ms, seq = self._last
        self._last = (ms, 0) if ms > last_ms else (last_ms, seq + 1)  # ids never go backwards, as in Redis
        return f"{self._last[0]}-{self._last[1]}"

    async def append(self, channel: str, payload: bytes) -> str:
        if self.closed:
            raise StoreError("store closed")
        log_ = self._logs.setdefault(channel, deque(maxlen=self._max))
        cid = self._next_id()
        log_.append((cid, payload))
        return cid

    async def read(self, channel: str, after: str, limit: int) -> list[tuple[str, bytes]]:
        if self.closed:
            raise StoreError("store closed")
        key = _cursor_key(after)
        out = []
        for cid, payload in self._logs.get(channel, ()):
            if _cursor_key(cid) > key:
                out.append((cid, payload))
                if len(out) >= limit:
                    break
        return out

    async def close(self) -> None:
        self.closed = True


def _cursor_key(cursor: str) -> tuple[int, int]:
    ms, _, seq = cursor.partition("-")
    return int(ms), int(seq or 0)


class RedisStore:
    """Channels as Redis streams, one key each: XADD trims entries older than the TTL (and beyond max_entries),
    XRANGE reads after a cursor.

    Every call has a short timeout and any Redis failure becomes StoreError: the caller degrades to local state.
    """

    def __init__(self, client, key_prefix: str, max_entries: int = 2_000, ttl_s: float = 600.0,
                 timeout_s: float = 0.25) -> None:
        self._r = client
        self._prefix = key_prefix
        self._max = max_entries
        self._ttl_ms = int(ttl_s * 1000)
        self._timeout = timeout_s

    @classmethod
    def from_url(cls, url: str, key_prefix: str, ttl_s: float, timeout_s: float,
                 max_entries: int = 2_000) -> "RedisStore":
        client = redis_asyncio.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, key_prefix, max_entries=max_entries, ttl_s=ttl_s, timeout_s=timeout_s)

    async def _call(self, coro):
        try:
            async with asyncio.timeout(self._timeout):
                return await coro
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreError(f"{type(e).__name__}: {e}") from e

    async def append(self, channel: str, payload: bytes) -> str:
        key = self._prefix + channel
        oldest = int(time.time() * 1000) - self._ttl_ms
        async with self._r.pipeline(transaction=False) as p:
            p.xadd(key, {"p": payload}, minid=f"{max(oldest, 0)}-0", approximate=True)  # nobody reads older
            p.xtrim(key, maxlen=self._max, approximate=True)  # a hard bound whatever the write rate
            p.pexpire(key, self._ttl_ms)  # an abandoned channel disappears on its own
            cid, _, _ = await self._call(p.execute())
        return cid.decode() if isinstance(cid, bytes) else str(cid)

    async def read(self, channel: str, after: str, limit: int) -> list[tuple[str, bytes]]:
        rows = await self._call(self._r.xrange(self._prefix + channel, min=f"({after}", count=limit))
        out = []
        for cid, fields in rows:
            payload = fields.get(b"p") if isinstance(fields, dict) else None
            if payload is not None:
                out.append((cid.decode() if isinstance(cid, bytes) else str(cid), payload))
        return out

    async def close(self) -> None:
        await self._r.aclose()


class AffinityIndex:
    """Prefix block hash or session -> the backend that served it last; bounded (LRU) and expiring.

    One OrderedDict of 63-bit keys to packed ints (expiry in ms << 12 | backend ordinal): about 140 bytes an
    entry on CPython 3.11 (14 MB at the default cap of 100,000). Prefix hashes are seeded with the model (shape.prefix_hashes), so the index is per model.
    lookup() and record() are synchronous and touch only local memory; sharing happens in sync().
    """

    def __init__(self, *, max_entries: int, ttl_s: float, block_chars: int, clock: Clock = time.monotonic,
                 shared: bool = False, max_pending: int = 50_000) -> None:
        self.max_entries = max_entries
        self.ttl_ms = int(ttl_s * 1000)
        self.block_tokens = max(block_chars // CHARS_PER_TOKEN, 1)
        self._clock = clock
        self._t0 = clock()
        self._map: OrderedDict[int, int] = OrderedDict()
        self._backends: list[str] = []
        self._ordinal: dict[str, int] = {}
        self.shared = shared
        self.replica = secrets.token_hex(6)
        self._pending: dict[str, set[int]] = {}
        self._pending_n = 0
        self._max_pending = max_pending
        self.dropped = 0
        self.cursor: str | None = None
        self.store_errors = 0

    def __len__(self) -> int:
        return len(self._map)

    def _now_ms(self) -> int:
        return int((self._clock() - self._t0) * 1000)

    def ordinal(self, backend: str) -> int:
        o = self._ordinal.get(backend)
        if o is None:
            if len(self._backends) >= MAX_BACKENDS:
                # Backends come from config: this only happens after thousands of reloads. Start over.
                self._map.clear()
                self._backends.clear()
                self._ordinal.clear()
            o = len(self._backends)
            self._backends.append(backend)
            self._ordinal[backend] = o
        return o

    def _get(self, key: int, now_ms: int) -> str | None:
        v = self._map.get(key)
        if v is None or (v >> ORD_BITS) < now_ms:
            return None
        return self._backends[v & ORD_MASK] or None

    def lookup(self, shape: RequestShape) -> tuple[str | None, int]:
        """The backend to stick to and how many prompt tokens it likely has cached (0 if only the session says)."""
        now_ms = self._now_ms()
        hashes = shape.prefix_hashes
        prefix_backend, blocks = None, 0
        for i in range(len(hashes) - 1, -1, -1):  # longest match first; misses cost one dict probe each
            b = self._get(hashes[i], now_ms)
            if b is not None:
                prefix_backend, blocks = b, i + 1
                break
        if shape.session_id:
            pinned = self._get(session_key(shape.model, shape.session_id), now_ms)
            if pinned is not None:
                return pinned, (blocks * self.block_tokens if pinned == prefix_backend else 0)
        return prefix_backend, blocks * self.block_tokens

    def record(self, shape: RequestShape, backend: str) -> None:
        """Remember that `backend` just served this prompt (and session)."""
        keys: Iterable[int] = shape.prefix_hashes
        if shape.session_id:
            keys = (*shape.prefix_hashes, session_key(shape.model, shape.session_id))
        self._put(keys, self.ordinal(backend), self._now_ms() + self.ttl_ms)
        if self.shared:
            if self._pending_n >= self._max_pending:
                self.dropped += 1  # the store is behind or down: replicas simply learn less
                return
            bucket = self._pending.setdefault(backend, set())
            before = len(bucket)
            bucket.update(keys)
            self._pending_n += len(bucket) - before

    def _put(self, keys: Iterable[int], ordinal: int, expires_ms: int) -> None:
        m = self._map
        value = (expires_ms << ORD_BITS) | ordinal
        for k in keys:
            m[k] = value
            m.move_to_end(k)
        while len(m) > self.max_entries:
            m.popitem(last=False)

    def forget_backend(self, backend: str) -> None:
        """A removed backend: its entries stop matching (they age out of the LRU on their own)."""
        o = self._ordinal.pop(backend, None)
        if o is not None:
            self._backends[o] = ""  # if the id comes back it gets a new ordinal: old entries stay dead

    # -- sharing -----------------------------------------------------------------------------------
    def take_pending(self) -> bytes | None:
        if not self._pending:
            return None
        batch = {"r": self.replica, "e": {b: sorted(keys) for b, keys in self._pending.items()}}
        self._pending = {}
        self._pending_n = 0
        return orjson.dumps(batch)

    def merge(self, cursor: str, payload: bytes, wall_now_ms: int) -> int:
        """Apply another replica's batch; returns how many keys it set."""
        try:
            batch = orjson.loads(payload)
            if batch.get("r") == self.replica:
                return 0
            age_ms = max(wall_now_ms - cursor_ms(cursor), 0)
            if age_ms >= self.ttl_ms:
                return 0
            expires = self._now_ms() + self.ttl_ms - age_ms
            n = 0
            for backend, keys in batch.get("e", {}).items():
                if isinstance(backend, str) and backend and isinstance(keys, list):
                    self._put((k for k in keys if isinstance(k, int)), self.ordinal(backend), expires)
                    n += len(keys)
            return n
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            log.warning("ignoring a malformed affinity batch %s: %s", cursor, e)
            return 0

    async def sync(self, store: StateStore, wall_clock: Clock = time.time, max_reads: int = 20,
                   read_limit: int = 500) -> None:
        """One round trip with the store: publish what this replica learned, then apply what others did."""
        payload = self.take_pending()
        try:
            if payload is not None:
                await store.append(AFFINITY_CHANNEL, payload)
            now_ms = int(wall_clock() * 1000)
            if self.cursor is None:  # first sync: start from what is still fresh
                self.cursor = f"{max(now_ms - self.ttl_ms, 0)}-0"
            for _ in range(max_reads):
                rows = await store.read(AFFINITY_CHANNEL, self.cursor, read_limit)
                for cid, data in rows:
                    self.merge(cid, data, now_ms)
                    self.cursor = cid
                if len(rows) < read_limit:
                    break
        except StoreError as e:
            self.store_errors += 1
            if self.store_errors == 1 or self.store_errors % 100 == 0:
                log.warning("shared state unavailable, routing on local state (%d errors): %s",
                            self.store_errors, e)


async def sync_loop(index: AffinityIndex, store: StateStore, interval_s: float, stop: asyncio.Event) -> None:
    """Share the affinity index with the other replicas every interval until `stop` is set.

    A flag rather than task.cancel(): a cancellation that lands inside the Redis client's I/O can be
    absorbed there, and the loop would then never end.
    """
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await stop.wait()
        if not stop.is_set():
            await index.sync(store)
