"""Where the usage ledger's rows are kept: this process's memory, or hourly Redis hashes every replica adds to.

Both stores take batches of rows (gateway/stats/ledger.py) from the flush loop, never from a request, and answer
the rows of a range of hours. In Redis each hour is one hash, `<key_prefix>usage:<hour>`, a field per row and
count (its name a JSON array: key, model, API, backend, count), added to with HINCRBY and expiring
`retention_days` after its hour ends. A batch goes in by one script that first marks the batch's id as applied:
a batch sent again after a timeout (its first try may have been applied) is never counted twice.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from typing import Protocol

import orjson
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.config import StateConfig
from gateway.stats.ledger import COUNTS, N_COUNTS, Ledger, Row

log = logging.getLogger("shapegate.usage")

Batch = dict[Row, list[int]]
MAX_MEMORY_ROWS = 500_000  # rows the memory store keeps; past it, its oldest hours go first
MAX_WAITING_ROWS = 200_000  # rows of batches Redis has not taken yet; past it, the oldest batch is lost
MARK_TTL_S = 3600  # how long an applied batch's id is remembered (a batch is retried within it)
MAX_COUNT = 2 ** 62  # a count read from the store past this is not a count
READ_TIMEOUT_S = 10.0  # a report's read (an admin's request, days of hashes): longer than a flush may take


class UsageStore(Protocol):
    """Rows added in batches, read back by hour range. `kind` names it in reports."""

    kind: str

    async def add(self, batch: Batch, retention_days: int, batch_id: str) -> None:
        """Add the counts of `batch`, once whatever the number of tries under one `batch_id`; raises StoreError
        when it cannot be added now (it is tried again)."""

    async def read(self, first_hour: int, last_hour: int) -> Batch:
        """Every row of the hours first_hour..last_hour (both included); StoreError when the store cannot answer."""

    async def close(self) -> None: ...


class StoreError(Exception):
    """The store did not take a batch or answer a read (Redis down, slow or full)."""


def merge_into(into: Batch, rows: Batch) -> None:
    for row, counts in rows.items():
        have = into.get(row)
        if have is None:
            into[row] = list(counts)
        else:
            for i, n in enumerate(counts):
                have[i] += n


class MemoryStore:
    """This process's rows, hour by hour; hours past the retention are dropped as batches come in."""

    kind = "memory"

    def __init__(self, max_rows: int = MAX_MEMORY_ROWS) -> None:
        self._hours: dict[int, Batch] = {}
        self._rows = 0
        self._max_rows = max_rows
        self.dropped_hours = 0  # hours dropped early to keep within max_rows
        self._applied: collections.deque[str] = collections.deque(maxlen=1024)  # the last batches' ids

    async def add(self, batch: Batch, retention_days: int, batch_id: str = "") -> None:
        if batch_id:
            if batch_id in self._applied:
                return
            self._applied.append(batch_id)
        for row, counts in batch.items():
            hour = self._hours.setdefault(row[0], {})
            have = hour.get(row)
            if have is None:
                hour[row] = list(counts)
                self._rows += 1
            else:
                for i, n in enumerate(counts):
                    have[i] += n
        oldest = int(time.time() // 3600) - retention_days * 24
        for h in sorted(self._hours):
            if h >= oldest and self._rows <= self._max_rows:
                break
            if h >= oldest:
                self.dropped_hours += 1
            self._rows -= len(self._hours.pop(h))

    async def read(self, first_hour: int, last_hour: int) -> Batch:
        out: Batch = {}
        for h, rows in self._hours.items():
            if first_hour <= h <= last_hour:
                out.update((row, list(counts)) for row, counts in rows.items())
        return out

    async def close(self) -> None:
        pass


# KEYS: the batch's mark, then each hour's hash. ARGV: the mark's TTL, then per hash its EXPIREAT time and number
# of (field, increment) pairs, then the pairs.
_APPLY = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
local at = 2
for i = 2, #KEYS do
  local expire_at, n = ARGV[at], tonumber(ARGV[at + 1])
  at = at + 2
  for _ = 1, n do
    redis.call('HINCRBY', KEYS[i], ARGV[at], ARGV[at + 1])
    at = at + 2
  end
  redis.call('EXPIREAT', KEYS[i], expire_at)
end
return 1
"""
_CODES = {name: i for i, name in enumerate(COUNTS)}


def field_name(row: Row, count: int) -> bytes:
    return orjson.dumps([row[1], row[2], row[3], row[4], COUNTS[count]])


def read_field(hour: int, field: bytes, value: bytes) -> tuple[Row, int, int] | None:
    """A hash field and its value as another process wrote them, checked as a client's input would be: (row,
    count index, n), or None when it is not one of ours."""
    try:
        parts = orjson.loads(field)
        n = int(value)
    except (orjson.JSONDecodeError, ValueError):
        return None
    if not isinstance(parts, list) or len(parts) != 5 or not all(isinstance(p, str) for p in parts):
        return None
    count = _CODES.get(parts[4])
    if count is None or not 0 <= n <= MAX_COUNT:
        return None
    return (hour, parts[0], parts[1], parts[2], parts[3]), count, n


class RedisStore:
    """Rows in hourly hashes shared by every replica on the Redis store."""

    kind = "redis"

    def __init__(self, state: StateConfig) -> None:
        self._prefix = state.key_prefix + "usage:"
        self._timeout = state.redis_timeout_s
        self._client = redis_asyncio.Redis.from_url(state.redis_url, socket_timeout=state.redis_timeout_s,
                                                    socket_connect_timeout=state.redis_timeout_s)
        self._apply = self._client.register_script(_APPLY)
        self._reader = redis_asyncio.Redis.from_url(state.redis_url, socket_timeout=READ_TIMEOUT_S,
                                                    socket_connect_timeout=state.redis_timeout_s)

    def hash_key(self, hour: int) -> str:
        return f"{self._prefix}{hour}"

    async def add(self, batch: Batch, retention_days: int, batch_id: str = "") -> None:
        by_hour: dict[int, list[bytes | int]] = {}
        for row, counts in batch.items():
            pairs = by_hour.setdefault(row[0], [])
            for i, n in enumerate(counts):
                if n:
                    pairs += (field_name(row, i), n)
        keys: list[str] = [f"{self._prefix}batch:{batch_id or secrets.token_hex(8)}"]
        args: list[bytes | int | str] = [MARK_TTL_S]
        for hour, pairs in by_hour.items():
            if not pairs:
                continue
            keys.append(self.hash_key(hour))
            args += [(hour + 1) * 3600 + retention_days * 86400, len(pairs) // 2, *pairs]
        if len(keys) == 1:
            return
        try:
            async with asyncio.timeout(self._timeout * 4):  # a large batch may take more than one call's time
                await self._apply(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreError(f"{type(e).__name__}: {e}") from e

    async def read(self, first_hour: int, last_hour: int) -> Batch:
        hours = list(range(first_hour, last_hour + 1))
        out: Batch = {}
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                async with self._reader.pipeline(transaction=False) as p:
                    for h in hours:
                        p.hgetall(self.hash_key(h))
                    replies = await p.execute()
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreError(f"{type(e).__name__}: {e}") from e
        for hour, fields in zip(hours, replies):
            for field, value in fields.items():
                got = read_field(hour, field, value)
                if got is None:
                    continue  # not a field of ours: left out
                row, count, n = got
                counts = out.get(row)
                if counts is None:
                    counts = out[row] = [0] * N_COUNTS
                counts[count] += n
            await asyncio.sleep(0)  # a long range is read in hours, not in one hold of the loop
        return out

    async def close(self) -> None:
        await self._client.aclose()
        await self._reader.aclose()


class Flusher:
    """Moves the ledger's rows to the store: batches the store did not take wait, in order, under their first id
    (so that a retry of a batch that was applied after all is not counted again), within MAX_WAITING_ROWS."""

    def __init__(self, ledger: Ledger, store: UsageStore) -> None:
        self.ledger = ledger
        self.store = store
        self.waiting: collections.deque[tuple[str, Batch]] = collections.deque()
        self.waiting_rows = 0
        self.errors = 0
        self.lost_rows = 0

    async def flush(self, retention_days: int) -> None:
        rows = self.ledger.take()
        if rows:
            self.waiting.append((secrets.token_hex(8), rows))
            self.waiting_rows += len(rows)
        while self.waiting_rows > MAX_WAITING_ROWS and len(self.waiting) > 1:
            _, lost = self.waiting.popleft()
            self.waiting_rows -= len(lost)
            self.lost_rows += len(lost)
            log.error("usage rows lost: the store has not taken them for too long (%d rows so far)", self.lost_rows)
        while self.waiting:
            batch_id, batch = self.waiting[0]
            try:
                await self.store.add(batch, retention_days, batch_id)
            except StoreError as e:
                self.errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.warning("usage not written to the store (%d errors; kept and tried again): %s",
                                self.errors, e)
                return
            self.waiting.popleft()
            self.waiting_rows -= len(batch)

    def unsent(self) -> Batch:
        """What the store has not taken yet, this process's (the ledger's rows and the batches waiting)."""
        out: Batch = {}
        for _, batch in self.waiting:
            merge_into(out, batch)
        return out


async def flush_loop(flusher: Flusher, settings, stop: asyncio.Event) -> None:
    """Every `settings().flush_interval_s` until `stop`, then once more: the ledger's rows to the store.
    `settings` returns the [usage] section in force (a reload may change the interval and the retention).
    A flag ends it, not task.cancel(): a cancellation inside the Redis client's I/O can be absorbed there."""
    try:
        while not stop.is_set():
            try:
                async with asyncio.timeout(settings().flush_interval_s):
                    await stop.wait()
            except TimeoutError:
                pass
            try:
                await flusher.flush(settings().retention_days)
            except Exception:  # a bug, or a value no check foresaw: this round is lost, never the loop
                log.exception("usage flush round failed")
    finally:
        await flusher.store.close()


def make_store(state: StateConfig) -> UsageStore:
    return RedisStore(state) if state.backend == "redis" else MemoryStore()
