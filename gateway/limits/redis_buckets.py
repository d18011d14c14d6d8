"""Rate-limit buckets shared by replicas through Redis: one atomic script per request, settlement batched off the
request path, and this process's own share of each limit while Redis is slow or down."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gateway.config import StateConfig
from gateway.limits.resp import RespConnection, RespError

if TYPE_CHECKING:
    from gateway.limits.limiter import Need
    from gateway.observe.metrics import Metrics

log = logging.getLogger("shapegate.limits")

SETTLE_S = 0.1  # settlements are sent in one batch this often
PROBE_S = 0.5  # while Redis is unusable, it is asked this often whether it is back
MAX_BATCH = 512  # buckets per settlement call

# The level of bucket i now: its stored level refilled at limit/60 per second since it was stored, at most the
# limit; an absent key is a full bucket. Redis's own clock (TIME, in ms), so replicas' clocks never matter.
_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS
local function level(i, limit)
  local v = redis.call('HMGET', KEYS[i], 'l', 't')
  if not v[1] then return limit end
  return math.min(limit, tonumber(v[1]) + math.max(now - tonumber(v[2]), 0) * limit / 60000)
end
local function store(i, limit, l)
  if l >= limit then redis.call('DEL', KEYS[i]) return end
  redis.call('HSET', KEYS[i], 'l', string.format('%.17g', l), 't', string.format('%d', now))
  -- The key lives until its bucket would be full again: an expired key is a full bucket.
  redis.call('PEXPIRE', KEYS[i], math.ceil((limit - l) * 60000 / limit) + 1000)
end
"""
# ARGV: n limits, then n costs. All buckets or none are charged. Returns the first bucket without room (0: none)
# and every level, after the charge when there was one.
TAKE = _LEVEL + """
local levels, refused = {}, 0
for i = 1, n do
  levels[i] = level(i, tonumber(ARGV[i]))
  if refused == 0 and levels[i] < tonumber(ARGV[n + i]) then refused = i end
end
local out = {refused}
for i = 1, n do
  if refused == 0 then
    levels[i] = levels[i] - tonumber(ARGV[n + i])
    store(i, tonumber(ARGV[i]), levels[i])
  end
  out[i + 1] = string.format('%.17g', levels[i])
end
return out
"""
# ARGV: n limits, then n token counts to charge (a refund when negative), whatever the level.
SETTLE = _LEVEL + """
for i = 1, n do
  local limit = tonumber(ARGV[i])
  store(i, limit, math.min(limit, level(i, limit) - tonumber(ARGV[n + i])))
end
return n
"""

FAILURES = (RespError, OSError, TimeoutError)  # ConnectionError is an OSError
SHA = {script: hashlib.sha1(script.encode()).hexdigest() for script in (TAKE, SETTLE)}


class SharedBuckets:
    """The buckets in Redis, over one pipelined connection per process (see gateway/limits/resp.py). take() answers None
    whenever this process must decide alone: Redis failed or did not answer within the limit check's timeout
    (counted by reason), or is known to be unusable; a probe off the request path reconnects and brings the
    shared buckets back as soon as Redis answers."""

    def __init__(self, state: StateConfig, metrics: Metrics) -> None:
        self.url = state.redis_url
        self.prefix = f"{state.key_prefix}ratelimit:"
        self.background_timeout_s = state.redis_timeout_s
        self.metrics = metrics
        self.conn: RespConnection | None = None
        self.up = False  # until connected (at start-up, by running())
        self.on_recover = lambda: None  # set by the limiter: its local buckets start afresh at the next outage
        self._pending: dict[str, list[int]] = {}  # bucket -> [limit, tokens to charge]; one entry per bucket
        self._probe: asyncio.Task | None = None
        self.dropped = 0  # settlements lost to a failed or unusable Redis

    async def _eval(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA; a server that lost its scripts (restarted, flushed) gets the script again, once."""
        assert self.conn is not None
        try:
            return await self.conn.call("EVALSHA", SHA[script], len(keys), *keys, *args)
        except RespError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        await self.conn.call("SCRIPT", "LOAD", script)
        return await self.conn.call("EVALSHA", SHA[script], len(keys), *keys, *args)

    async def take(self, needs: tuple[Need, ...], costs: tuple[int, ...],
                   timeout_s: float) -> tuple[int, list[float]] | None:
        """(index of the first bucket without room or -1, levels), or None: decide locally."""
        if not self.up:
            self.metrics.limit_local("unavailable")
            return None
        try:
            async with asyncio.timeout(timeout_s):
                out = await self._eval(TAKE, [self.prefix + n.name for n in needs], [*(n.limit for n in needs), *costs])
        except TimeoutError as e:
            self.metrics.limit_local("timeout")
            self._down(e)
            return None
        except FAILURES as e:
            self.metrics.limit_local("error")
            self._down(e)
            return None
        return int(out[0]) - 1, [float(v) for v in out[1:]]

    def settle(self, needs: tuple[Need, ...], delta: int) -> None:
        """Queue a settlement; merged per bucket, so what waits is bounded by the number of buckets."""
        for n in needs:
            entry = self._pending.get(n.name)
            if entry is None:
                self._pending[n.name] = [n.limit, delta]
            else:
                entry[0], entry[1] = n.limit, entry[1] + delta

    def _down(self, e: BaseException) -> None:
        """Redis failed or is too slow: every check decides locally until the probe finds it answering again."""
        if not self.up:
            return
        self.up = False
        if self.conn is not None:
            self.conn.close()  # a connection that missed a deadline may answer late: start the next one clean
        log.warning("rate limits enforced per process (this one's share) until Redis answers again: %s",
                    str(e) or type(e).__name__)
        self._probe = asyncio.create_task(self._probe_until_up(), name="limits-probe")

    async def _connect(self) -> None:
        async with asyncio.timeout(self.background_timeout_s):
            if self.conn is None or not self.conn.is_open:
                self.conn = await RespConnection.open(self.url)
            await self.conn.call("PING")
            for script in (TAKE, SETTLE):  # loaded once up front: checks then send only the digest
                await self.conn.call("SCRIPT", "LOAD", script)

    async def _probe_until_up(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            try:
                await self._connect()
            except FAILURES:
                if self.conn is not None:
                    self.conn.close()
                continue
            self.on_recover()
            self.up = True
            log.warning("rate limits shared through Redis again")
            return

    async def flush(self) -> None:
        """Send what is queued: a failure drops it (counted) rather than let it grow or hold anyone up."""
        while self._pending:
            batch = list(self._pending.items())[:MAX_BATCH]
            for name, _ in batch:
                del self._pending[name]
            if not self.up:
                self.dropped += len(batch)
                continue
            try:
                async with asyncio.timeout(self.background_timeout_s):
                    await self._eval(SETTLE, [self.prefix + name for name, _ in batch],
                                     [*(v[0] for _, v in batch), *(v[1] for _, v in batch)])
            except FAILURES as e:
                self.dropped += len(batch)
                self._down(e)

    async def _settle_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SETTLE_S):
                    await stop.wait()
            await self.flush()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The gateway's lifetime: connected and the scripts loaded up front, settlements sent until the end."""
        try:
            await self._connect()
            self.up = True
        except FAILURES as e:
            self.up = True  # so that _down() logs it and starts the probe
            self._down(e)
        stop = asyncio.Event()
        loop = asyncio.create_task(self._settle_loop(stop), name="limits-settle")
        try:
            yield
        finally:
            stop.set()
            await loop
            if self._probe is not None:
                self._probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._probe
            if self.conn is not None:
                self.conn.close()
