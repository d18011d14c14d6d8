"""Token quotas shared by replicas through Redis: their part of the take script, and their charges (settlements and
what was taken alone) queued per quota and sent in batches off the request path, never dropped."""

from __future__ import annotations

import hashlib
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
FINITE_LUA: Final = """
local function finite(x)
  return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge
end
"""
QSETTLE: Final = FINITE_LUA + QUOTA_LUA + QSETTLE_BODY
QSETTLE_SHA: Final = hashlib.sha1(QSETTLE.encode()).hexdigest()
MAX_QUOTA_BATCH: Final = 256  # quotas per call


class Charge:
    """Tokens to charge one quota's key, merged: its quota, the sum of the charges, when the key may go, and the
    slot they were charged to here (in `period`) so that what is sent leaves its `unsent`."""

    __slots__ = ("limit", "delta", "expire", "slot", "period")

    def __init__(self, limit: int, expire: int, slot: QuotaSlot, period: int) -> None:
        self.limit, self.delta, self.expire, self.slot, self.period = limit, 0, expire, slot, period

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

    async def send(self, run: Eval) -> None:
        """Send every pending charge in batches; what one that fails held is merged back (raises its error)."""
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
                        c.slot.heard(float(u))
        finally:
            for key, c in pending.items():  # not sent: back in the queue, merged with what came since
                later = self.pending.get(key)
                if later is not None:
                    c.delta += later.delta
                self.pending[key] = c
