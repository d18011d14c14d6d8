"""Rate-limit buckets shared by replicas through Redis: one atomic script per request, settlement batched off the
request path, and what this process decides alone (on its share while Redis is slow, down or full) owed back."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.config import StateConfig
from gateway.limits.buckets import Need
from gateway.limits.quotas import QuotaNeed, QuotaSlot, period_text
from gateway.limits.redis_quotas import QSETTLE, QTAKE, QUOTA_LUA, TAKE_ID_MS, QuotaCharges
from gateway.limits.resp import RespConnection, RespError

if TYPE_CHECKING:
    from gateway.observe.metrics import Metrics

log = logging.getLogger("shapegate.limits")

SETTLE_S = 0.1  # settlements are sent in one batch this often
PROBE_S = 0.5  # while Redis is unusable, it is asked this often whether it is back
MAX_BATCH = 512  # buckets per settlement call

# The level of bucket i now: its stored level refilled at limit/60 per second since it was stored, at most the
# limit (gateway/limits/buckets.py's level_at); an absent key is a full bucket. Redis's own clock (TIME, in ms),
# so replicas' clocks never matter.
# A malformed bucket (not a hash, a hash without either field, a field not a finite number) starts again EMPTY,
# rewritten at once,
# that key's alone: nothing tells how much of its limit was spent, and an empty bucket can hand out no credit that
# may already be gone (full could pass a whole limit more), while it costs the key at most a minute's refill. Any
# error raised here would fail the check and send this process to its local share for every key, hence pcall.
# A stamp ahead of Redis's clock (set back) keeps its level, restamped now: no refill is owed for time to come.
_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS
local function store(i, limit, l)
  if l >= limit then redis.call('DEL', KEYS[i]) return end
  redis.call('HSET', KEYS[i], 'l', string.format('%.17g', l), 't', string.format('%d', now))
  -- The key lives until its bucket would be full again: an expired key is a full bucket.
  redis.call('PEXPIRE', KEYS[i], math.ceil((limit - l) * 60000 / limit) + 1000)
end
local function finite(x)
  return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge
end
local function level(i, limit)
  local v = redis.pcall('HMGET', KEYS[i], 'l', 't')
  if v.err then
    redis.call('DEL', KEYS[i])
    store(i, limit, 0)
    return 0
  end
  if not v[1] and not v[2] and redis.call('EXISTS', KEYS[i]) == 0 then return limit end
  local l, at = tonumber(v[1]), tonumber(v[2])
  if not (finite(l) and finite(at)) then
    store(i, limit, 0)
    return 0
  end
  if at > now then
    l = math.min(limit, l)
    store(i, limit, l)
    return l
  end
  return math.min(limit, l + (now - at) * limit / 60000)
end
"""
# KEYS: b buckets, then the quotas (gateway/limits/redis_quotas.py) and, with quotas, the take's own key (its id:
# set when the quotas are charged, so that a process that did not hear the answer and charges them alone later
# does not charge them twice: QTAKE). ARGV: b, the b limits, the b costs, then per
# quota: its tokens, the cost, the floor, when its key may go (ms), and what the caller charged it and has not
# sent yet (counted in the check, not charged: it comes with the caller's next batch). All buckets and quotas or
# none are charged.
# Returns the first without room (0: none; quotas first: the longer wait), every bucket's level and every quota's
# tokens used, after the charge when there was one.
TAKE = _LEVEL + QUOTA_LUA + """
local b = tonumber(ARGV[1])
local levels, used, refused = {}, {}, 0
local m = 0
if n > b then m = n - b - 1 end
for i = 1, b do
  levels[i] = level(i, tonumber(ARGV[1 + i]))
end
for j = 1, m do
  local a = 1 + 2 * b + 5 * (j - 1)
  local quota = tonumber(ARGV[a + 1])
  local u, bad = used_of(b + j, quota, tonumber(ARGV[a + 3]))
  if bad then store_used(b + j, u, tonumber(ARGV[a + 4])) end
  used[j] = u
  if refused == 0 and u + tonumber(ARGV[a + 2]) + tonumber(ARGV[a + 5]) > quota then refused = b + j end
end
if refused == 0 then
  for i = 1, b do
    if levels[i] < tonumber(ARGV[1 + b + i]) then refused = i break end
  end
end
local out = {refused}
for i = 1, b do
  if refused == 0 then
    levels[i] = levels[i] - tonumber(ARGV[1 + b + i])
    store(i, tonumber(ARGV[1 + i]), levels[i])
  end
  out[i + 1] = string.format('%.17g', levels[i])
end
if refused == 0 and m > 0 then redis.call('SET', KEYS[n], '1', 'PX', """ + str(TAKE_ID_MS) + """) end
for j = 1, m do
  local a = 1 + 2 * b + 5 * (j - 1)
  if refused == 0 then
    used[j] = used[j] + tonumber(ARGV[a + 2])
    store_used(b + j, used[j], tonumber(ARGV[a + 4]))
  end
  out[1 + b + j] = string.format('%.17g', used[j])
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
# A reply that is not TAKE's (a script of another version under the same name, a proxy's answer): a failure too.
TAKE_FAILURES = (*FAILURES, ValueError, TypeError, IndexError)
SHA = {script: hashlib.sha1(script.encode()).hexdigest() for script in (TAKE, SETTLE, QSETTLE, QTAKE)}
PROBE_LIMIT = 1 << 30  # the probe's bucket: never short, so that every probe writes
RESTART_HOLD_S = 60.0  # [limits] restart_hold_s's default: how long buckets of a Redis that restarted are not trusted
RUN_CHECK_S = 1.0  # while connected, whether Redis is still the same server is asked this often
SETTLED_S = PROBE_S + 5 * SETTLE_S  # Redis usable this long: every process sent what it took alone


def run_id_of(info: object) -> bytes:
    """The run_id line of INFO server's reply (a server that has none is read as one of its own: b"")."""
    if isinstance(info, bytes):
        for line in info.split(b"\r\n"):
            if line.startswith(b"run_id:"):
                return line[7:].strip()
    return b""


class SharedBuckets:
    """The buckets in Redis, over one pipelined connection per process (see gateway/limits/resp.py). take() answers None
    whenever this process must decide alone: Redis failed, answered with an error (a full Redis: OOM), or did not
    answer within the limit check's timeout (counted by reason), or is known to be unusable; a probe off the
    request path brings the shared buckets back once Redis takes a write again. What this process took alone is
    owed to the shared buckets and charged there when Redis is back (settle-like, off the request path)."""

    def __init__(self, state: StateConfig, metrics: Metrics) -> None:
        self.url = state.redis_url
        self.prefix = f"{state.key_prefix}ratelimit:"
        self.probe_key = f"{state.key_prefix}ratelimit-probe"  # a bucket of the probe's own, beside the keys' ones
        self.background_timeout_s = state.redis_timeout_s
        self.metrics = metrics
        self.conn: RespConnection | None = None
        self.up = False  # until connected (at start-up, by running())
        self.outages = 0  # times Redis became unusable: the limiter lowers a plan's local buckets once per outage
        self._pending: dict[str, list[int]] = {}  # bucket -> [limit, tokens to charge]; one entry per bucket
        # bucket -> [limit, what this process took alone]: kept across outages (bounded by the number of buckets)
        # and at most a limit each (what was taken more than a minute ago has been refilled by now anyway).
        self._owed: dict[str, list[int]] = {}
        self._probe: asyncio.Task | None = None
        self.dropped = 0  # settlements lost to a failed or unusable Redis
        # Which Redis this is (INFO server's run_id): a new one lost every bucket (restarted empty, or another
        # server behind the same address), so its buckets are not trusted until `untrusted_until` (monotonic).
        self.run_id: bytes | None = None
        self.untrusted_until = 0.0
        self.hold_s = RESTART_HOLD_S  # [limits] restart_hold_s, as the last check passed it
        self.restart_key = f"{state.key_prefix}ratelimit-restarted"  # tells processes that start meanwhile
        self.quotas = QuotaCharges()
        self.uncertain = False  # whether the last take that answered None may have been run by Redis all the same
        self.up_since = 0.0  # monotonic: when Redis became usable (again)
        self._token = secrets.token_hex(6)
        self._takes = 0
        # This process's view of every quota it saw used this period (the limiter's Quotas.known).
        self.quota_view: Callable[[], list[tuple[QuotaNeed, QuotaSlot]]] = list
        self._next_run_check = 0.0

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

    async def take(self, needs: tuple[Need, ...], costs: tuple[int, ...], timeout_s: float, hold_s: float = 60.0,
                   quota_keys: Sequence[str] = (), quota_args: Sequence[int] = (),
                   take_key: str = "") -> tuple[int, list[float]] | None:
        """(index of the first bucket or quota without room (quotas after the buckets) or -1, the buckets' levels
        then the quotas' tokens used), or None: decide locally. `hold_s`: how long buckets of a Redis that
        restarted are not trusted ([limits] restart_hold_s). `quota_args`: see limiter.quota_args; `take_key`:
        this take's own key (take_key()). After None, `uncertain` says whether Redis may have run it anyway
        (a timeout, a lost connection, a reply not understood)."""
        self.uncertain = False
        if not self.up:
            self.metrics.limit_local("unavailable")
            return None
        self.hold_s = hold_s
        if self.untrusted_until and time.monotonic() < self.untrusted_until:
            self.metrics.limit_local("restarted")
            return None
        try:
            async with asyncio.timeout(timeout_s):
                keys = [*(self.prefix + n.name for n in needs), *quota_keys, *((take_key,) if quota_keys else ())]
                out = await self._eval(TAKE, keys, [len(needs), *(n.limit for n in needs), *costs, *quota_args])
            return int(out[0]) - 1, [float(v) for v in out[1:]]
        except TimeoutError as e:
            self.metrics.limit_local("timeout")
            self.uncertain = True
            self._down(e)
        except TAKE_FAILURES as e:
            self.metrics.limit_local("error")
            self.uncertain = not isinstance(e, RespError)  # an error reply: the script did not run, or undid nothing
            self._down(e)
        return None

    def settled(self) -> bool:
        """Whether Redis has been usable long enough for every process to have sent what it took alone meanwhile
        (its probe, then a batch): what Redis says of a quota is then the whole story, and a process may split
        what is left again when it next decides alone (QuotaSlot.alone)."""
        return time.monotonic() - self.up_since >= SETTLED_S

    def take_key(self) -> str:
        """A key of its own for one take with quotas (see TAKE): unique across processes and restarts."""
        self._takes += 1
        return f"{self.prefix}quota-take:{self._token}:{self._takes}"

    def settle(self, needs: tuple[Need, ...], delta: int) -> None:
        """Queue a settlement; merged per bucket, so what waits is bounded by the number of buckets."""
        for n in needs:
            entry = self._pending.get(n.name)
            if entry is None:
                self._pending[n.name] = [n.limit, delta]
            else:
                entry[0], entry[1] = n.limit, entry[1] + delta

    def charge_quotas(self, keys: Sequence[str], needs: Sequence[QuotaNeed], slots: Sequence[QuotaSlot],
                      periods: Sequence[int], delta: int) -> None:
        """Queue a charge of `delta` tokens to each quota (a settlement, or what this process took alone)."""
        self.quotas.charge(keys, needs, slots, periods, delta)

    async def read_quotas(self, keys: list[str]) -> list[float | None] | None:
        """The tokens used of each quota key (None: none there, or not a number), read off the request path (a
        listing); None when Redis is unusable."""
        if not self.up or self.conn is None:
            return None
        try:
            async with asyncio.timeout(self.background_timeout_s * 4):
                values: list[Any] = []
                for start in range(0, len(keys), 1000):
                    values += await self.conn.call("MGET", *keys[start:start + 1000])
        except FAILURES:
            return None
        out: list[float | None] = []
        for v in values:
            try:
                out.append(float(v) if v is not None else None)
            except ValueError:
                out.append(None)
        return out

    def quota_key(self, need: QuotaNeed, slot: QuotaSlot) -> str:
        return f"{self.prefix}{need.name}:{period_text(need.period, slot.period)}"

    def owe(self, needs: tuple[Need, ...], costs: Sequence[int]) -> None:
        """What this process took from (or, settling, gave back to) its own buckets while deciding alone: charged
        to the shared buckets once Redis takes writes again, so that an outage's takes are not granted twice."""
        for n, cost in zip(needs, costs):
            self._owe(n.name, n.limit, cost)

    def _owe(self, name: str, limit: int, amount: int) -> None:
        entry = self._owed.get(name)
        if entry is None:
            self._owed[name] = [limit, min(limit, amount)]
        else:
            entry[0], entry[1] = limit, min(limit, entry[1] + amount)

    def _down(self, e: BaseException) -> None:
        """Redis failed or is too slow: every check decides locally until the probe finds it answering again."""
        if not self.up:
            return
        self.up = False
        self.outages += 1
        if self.conn is not None:
            self.conn.close()  # a connection that missed a deadline may answer late: start the next one clean
        log.warning("rate limits enforced per process (this one's share) until Redis takes writes again: %s",
                    str(e) or type(e).__name__)
        self._probe = asyncio.create_task(self._probe_until_up(), name="limits-probe")

    async def _connect(self, write: bool = False) -> None:
        """Connected and the scripts loaded; with `write`, a charge taken too: PING and SCRIPT LOAD pass on a full
        Redis (maxmemory, noeviction) where every charge fails, so the probe charges a bucket of its own."""
        async with asyncio.timeout(self.background_timeout_s):
            if self.conn is None or not self.conn.is_open:
                self.conn = await RespConnection.open(self.url)
            await self.conn.call("PING")
            await self._check_run()
            for script in (TAKE, SETTLE, QSETTLE, QTAKE):  # loaded once up front: checks then send only the digest
                await self.conn.call("SCRIPT", "LOAD", script)
            if write:
                await self.conn.call("EVALSHA", SHA[TAKE], 1, self.probe_key, 1, PROBE_LIMIT, 1)

    async def _check_run(self) -> None:
        """Whether this is still the Redis whose buckets this process used. One that is not lost them all (a
        restart without persistence, a failover to a replica behind, another server at the address): an empty
        bucket there reads as full, and every process would hand out a whole limit again. So its buckets are
        not trusted for `hold_s` (a bucket's refill from empty to full): each process keeps deciding alone on its
        own buckets, carried across, while what it takes alone is charged there as usual. The first process to
        notice leaves a key that lasts as long, so that a process starting meanwhile holds off too."""
        assert self.conn is not None
        self._next_run_check = time.monotonic() + RUN_CHECK_S
        run_id = run_id_of(await self.conn.call("INFO", "server"))
        hold_ms = int(self.hold_s * 1000)
        if self.run_id is not None and run_id != self.run_id:
            self.untrusted_until = time.monotonic() + self.hold_s
            self.outages += 1  # this process's buckets come down to its share of what it last saw, as in an outage
            self.quotas.restore_due = True  # and its view of each quota goes back (flush)
            if hold_ms > 0:
                await self.conn.call("SET", self.restart_key, run_id, "PX", hold_ms)
            log.warning("Redis restarted or was replaced (a new run id) and lost the rate-limit buckets: limits "
                        "enforced per process (this one's share, its buckets carried across) for %.0f s",
                        self.hold_s)
        elif self.run_id is None:  # this process's first: another may have seen a restart a moment ago
            left = await self.conn.call("PTTL", self.restart_key)
            if isinstance(left, int) and 0 < left <= hold_ms:
                self.untrusted_until = time.monotonic() + left / 1000.0
        self.run_id = run_id

    async def _probe_until_up(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            try:
                await self._connect(write=True)
            except FAILURES:
                if self.conn is not None:
                    self.conn.close()
                continue
            self.up, self.up_since = True, time.monotonic()
            log.warning("rate limits shared through Redis again")
            return

    async def _send(self, entries: dict[str, list[int]]) -> dict[str, list[int]]:
        """SETTLE `entries` in batches while Redis takes them; returns what was not sent (Redis down or failing)."""
        items = list(entries.items())
        for start in range(0, len(items), MAX_BATCH):
            batch = items[start:start + MAX_BATCH]
            if not self.up:
                return dict(items[start:])
            try:
                async with asyncio.timeout(self.background_timeout_s):
                    await self._eval(SETTLE, [self.prefix + name for name, _ in batch],
                                     [*(v[0] for _, v in batch), *(v[1] for _, v in batch)])
            except FAILURES as e:
                self._down(e)
                return dict(items[start:])
        return {}

    async def flush(self) -> None:
        """Send what is queued: a failure drops settlements (counted) rather than let them hold anyone up, and
        keeps what is owed (merged with what is owed since) for the next time Redis is usable. Every RUN_CHECK_S,
        first whether Redis is still the one it was (a proxy may keep the connection across a failover)."""
        if self.up and time.monotonic() >= self._next_run_check:
            try:
                async with asyncio.timeout(self.background_timeout_s):
                    await self._check_run()
            except FAILURES as e:
                self._down(e)
        if self.up and (self.quotas.restore_due or self.quotas.pending or self.quotas.takes):
            await self._flush_quotas()
        if self._owed and self.up:
            owed, self._owed = self._owed, {}
            for name, (limit, amount) in (await self._send(owed)).items():
                self._owe(name, limit, amount)  # possibly charged already (a late reply): erring on the limit's side
        if self._pending:
            pending, self._pending = self._pending, {}
            self.dropped += len(await self._send(pending))

    async def _flush_quotas(self) -> None:
        """A Redis that lost the quotas first gets this process's view of each; charges wait until its buckets
        are trusted again (so that every process's view is in before any charge), then go in batches."""
        async def run(keys: list[str], args: list[Any]) -> Any:
            async with asyncio.timeout(self.background_timeout_s):
                return await self._eval(QSETTLE, keys, args)

        try:
            if self.quotas.restore_due:
                await self.quotas.restore(run, self.quota_view(), self.quota_key)
            if not (self.untrusted_until and time.monotonic() < self.untrusted_until):
                if self.quotas.takes:
                    await self.quotas.send_takes(self._eval)
                if self.quotas.pending:
                    await self.quotas.send(run, self.settled())
        except FAILURES as e:
            self._down(e)
        except (ValueError, TypeError) as e:  # not QSETTLE's reply: kept, and sent again later
            log.warning("token quota charges not taken by Redis: %r", e)

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
            self.up, self.up_since = True, time.monotonic()
        except FAILURES as e:
            self.up = True  # so that _down() logs it, counts the outage and starts the probe
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
