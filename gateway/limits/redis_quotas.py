"""Token quotas shared by replicas through Redis: their part of the take script, and their charges (settlements and
what was taken alone) queued per quota and sent in batches off the request path, never dropped."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from gateway.limits.quotas import QuotaNeed, QuotaSlot, expire_ms

log = logging.getLogger("shapegate.limits")

# A quota's key holds the tokens used in its period, a number. Absent: the floor its caller passes (0 unless that
# process saw the quota used in this period: a key that vanished, flushed or evicted, starts again from what the
# process knew, not from nothing). Malformed (not a number, below zero, not a string): the quota is USED UP for
# the rest of its period, rewritten at once, that key's alone: nothing tells how much was spent, and a quota
# read as unused could hand out a whole day again. Each key expires a day after its period ends (PEXPIREAT).
# Needs `finite` (defined with the buckets' part of the script).
QUOTA_LUA: Final = """
local function used_of(k, quota, floor)
  local v = redis.pcall('GET', KEYS[k])
  if type(v) == 'table' and v.err then
    redis.call('DEL', KEYS[k])
    return quota, true
  end
  if not v then return floor, false end
  local u = tonumber(v)
  if not finite(u) or u < 0 then return quota, true end
  return u, false
end
local function store_used(k, u, expire_at)
  redis.call('SET', KEYS[k], string.format('%.17g', u))
  redis.call('PEXPIREAT', KEYS[k], expire_at)
end
"""
# KEYS: quotas. ARGV[1]: 'add' (charge each its delta: settlements and what a process took alone) or 'max' (a
# process's view of a quota in a Redis that lost it: the larger of the two), then per key: quota, delta, floor,
# expire-at (ms). Returns each quota's used tokens after.
QSETTLE_BODY: Final = """
local out = {}
for k = 1, #KEYS do
  local a = 1 + 4 * (k - 1)
  local quota, delta, floor = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local u, bad = used_of(k, quota, floor)
  if bad then
    u = quota
  elseif ARGV[1] == 'max' then
    u = math.max(u, floor)
  else
    u = math.max(0, u + delta)
  end
  store_used(k, u, tonumber(ARGV[a + 4]))
  out[k] = string.format('%.17g', u)
end
return out
"""
# How long a take's own key says it was charged. The process that lost the answer tells Redis within a second of
# it answering again (the probe, then the next batch), and the script ran only once Redis answered again: a minute
# is room enough, and a key per request with quotas for a minute is what it costs (about 100 bytes each).
TAKE_ID_MS: Final = 60_000
# KEYS[1]: a take's own key; then its quotas. ARGV per quota: quota, tokens, floor, expire-at. What a process took
# alone after its take's answer was lost (a timeout: Redis may have run it all the same): charged unless the take's
# key says it was. Returns 1 when charged here, 0 when it had been.
QTAKE_BODY: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for k = 2, #KEYS do
  local a = 4 * (k - 2)
  local quota = tonumber(ARGV[a + 1])
  local u, bad = used_of(k, quota, tonumber(ARGV[a + 3]))
  if bad then u = quota else u = u + tonumber(ARGV[a + 2]) end
  store_used(k, u, tonumber(ARGV[a + 4]))
end
redis.call('SET', KEYS[1], '1', 'PX', """ + str(TAKE_ID_MS) + """)
return 1
"""
FINITE_LUA: Final = """
local function finite(x)
  return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge
end
"""
QSETTLE: Final = FINITE_LUA + QUOTA_LUA + QSETTLE_BODY
QTAKE: Final = FINITE_LUA + QUOTA_LUA + QTAKE_BODY
MAX_QUOTA_BATCH: Final = 256  # quotas per call


class Charge:
    """Tokens to charge one quota's key, merged: its quota, the sum of the charges, when the key may go, and the
    slot they were charged to here (in `period`) so that what is sent leaves its `unsent`."""

    __slots__ = ("limit", "delta", "expire", "slot", "period", "key")

    def __init__(self, limit: int, expire: int, slot: QuotaSlot, period: int, key: str = "") -> None:
        self.limit, self.delta, self.expire, self.slot, self.period, self.key = limit, 0, expire, slot, period, key

    def floor(self) -> int:
        """What this process knows the key held before its unsent charges (0 once the slot moved on)."""
        s = self.slot
        return max(int(s.used - s.unsent), 0) if s.period == self.period else 0


Eval = Callable[[list[str], list[Any]], Awaitable[Any]]


class QuotaCharges:
    """Every quota charge this process has not sent yet, one entry per key, bounded by the keys in use. A charge
    is never dropped: one that Redis did not take is sent again with the next batch."""

    def __init__(self) -> None:
        self.pending: dict[str, Charge] = {}
        self.restore_due = False  # a Redis that lost the quotas is told this process's view of each, once
        # take key -> what it charged each quota, for takes whose answer was lost (one per such take: few, since
        # the process decides alone without asking after one) and that it served alone.
        self.takes: dict[str, list[Charge]] = {}

    def charge_take(self, take_key: str, keys: Sequence[str], needs: Sequence[QuotaNeed], slots: Sequence[QuotaSlot],
                    periods: Sequence[int], tokens: int) -> None:
        """A take Redis may have run, served alone: its tokens charged unless its key says they were."""
        charges = []
        for key, n, s, period in zip(keys, needs, slots, periods):
            c = Charge(n.limit, expire_ms(n.period, period), s, period, key)
            c.delta = tokens
            if s.period == period:
                s.unsent += tokens
            charges.append(c)
        self.takes[take_key] = charges

    async def send_takes(self, run: Callable[[str, list[str], list[Any]], Awaitable[Any]]) -> None:
        """Send each lost take's charge (QTAKE); one that fails stays for the next round (raises its error)."""
        for take_key, charges in list(self.takes.items()):
            args: list[Any] = []
            for c in charges:
                args += [c.limit, c.delta, c.floor(), c.expire]
            await run(QTAKE, [take_key, *(c.key for c in charges)], args)
            del self.takes[take_key]
            for c in charges:
                if c.slot.period == c.period:
                    c.slot.unsent -= c.delta

    def charge(self, keys: Sequence[str], needs: Sequence[QuotaNeed], slots: Sequence[QuotaSlot],
               periods: Sequence[int], delta: int) -> None:
        for key, n, s, period in zip(keys, needs, slots, periods):
            c = self.pending.get(key)
            if c is None:
                c = self.pending[key] = Charge(n.limit, expire_ms(n.period, period), s, period)
            c.delta += delta
            if s.period == period:
                s.unsent += delta

    async def restore(self, run: Eval, known: list[tuple[QuotaNeed, QuotaSlot]], key_of: Callable[[QuotaNeed,
                      QuotaSlot], str]) -> None:
        """Tell Redis what this process knew each quota held (the larger of that and what it holds now stays)."""
        items = [(key_of(n, s), [n.limit, 0, max(int(s.used - s.unsent), 0), expire_ms(n.period, s.period)])
                 for n, s in known]
        for start in range(0, len(items), MAX_QUOTA_BATCH):
            batch = items[start:start + MAX_QUOTA_BATCH]
            await run([k for k, _ in batch], ["max", *(v for _, args in batch for v in args)])
        self.restore_due = False
        if items:
            log.warning("told Redis the token quotas this process knew of (%d): it had lost them", len(items))

    async def send(self, run: Eval, settled: bool) -> None:
        """Send every pending charge in batches; what one that fails held is merged back (raises its error).
        `settled`: see SharedBuckets.settled."""
        pending, self.pending = self.pending, {}
        items = list(pending.items())
        try:
            for start in range(0, len(items), MAX_QUOTA_BATCH):
                batch = items[start:start + MAX_QUOTA_BATCH]
                args: list[Any] = ["add"]
                for _, c in batch:
                    args += [c.limit, c.delta, c.floor(), c.expire]
                used = await run([k for k, _ in batch], args)
                for (key, c), u in zip(batch, used):
                    del pending[key]
                    if c.slot.period == c.period:
                        c.slot.unsent -= c.delta
                        c.slot.heard(float(u), settled)
        finally:
            for key, c in pending.items():  # not sent: back in the queue, merged with what came since
                later = self.pending.get(key)
                if later is not None:
                    c.delta += later.delta
                self.pending[key] = c
