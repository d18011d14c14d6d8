"""Token buckets: the identity of one (Need), its refill, and this process's buckets (Buckets)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

# Why token buckets: a bucket holds up to the per-minute limit and refills continuously at limit/60 per second,
# so a key may burst up to its limit and then gets a steady rate, with no burst of twice the limit at a window
# edge as fixed windows allow. OpenAI's "reset" is then the time until the bucket is full again. State is two
# numbers per bucket (level and when it was taken), small enough for one atomic Redis script per request (its
# Lua in gateway/limits/redis_buckets.py refills the same way). A request draws from every bucket it needs or
# from none; costs and a full bucket are whole numbers, so the check holds exactly at the boundary (rpm = 60:
# sixty requests at once pass, the sixty-first does not).
REQUESTS: Final = "requests"
TOKENS: Final = "tokens"
KINDS: Final = (REQUESTS, TOKENS)
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Need:
    """One bucket a request draws from: its identity (kind, key id and model; never the key), and limit."""

    name: str
    kind: str
    limit: int  # per minute
    model: str | None = None


def level_at(slot: list[float], cap: float, now: float) -> float:
    """A bucket's level at `now`: [level, taken at] refilled at cap/60 per second since, and never past cap."""
    level = slot[0] + (now - slot[1]) * (cap / 60.0)
    return cap if level > cap else level


class Buckets:
    """Token buckets of one process: [level, taken at] by bucket name. Used for every decision with memory state,
    and while the shared store does not answer with Redis state (then kept across outages and recoveries, never
    refilled but by time: a flapping Redis hands out no fresh bursts). A plan holds its buckets' state lists
    (bound once), so a request finds them without a lookup; an unused bucket is full (level infinite, cut to its
    limit when read)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, list[float]] = {}  # name -> [level, taken at] (a monotonic clock)

    def slots(self, needs: tuple[Need, ...]) -> tuple[list[float], ...]:
        return tuple([self._state.setdefault(n.name, [math.inf, 0.0]) for n in needs])

    def take_slots(self, slots: tuple[list[float], ...], caps: tuple[float, ...], costs: tuple[int, ...],
                   now: float) -> tuple[int, list[float]]:
        """(index of the first bucket without room, or -1 when all had room and were charged; levels after)."""
        levels = []
        short = -1
        for i, s in enumerate(slots):  # one pass to check, one to charge: the per-request path
            level = level_at(s, caps[i], now)
            if short < 0 and level < costs[i]:
                short = i
            levels.append(level)
        if short >= 0:
            return short, levels
        for i, s in enumerate(slots):
            levels[i] = s[0] = levels[i] - costs[i]
            s[1] = now
        return -1, levels

    def adjust_slots(self, slots: tuple[list[float], ...], caps: tuple[float, ...], delta: int) -> None:
        """Charge `delta` more tokens (a refund when negative) once a request's usage is known."""
        now = self.clock()
        for s, cap in zip(slots, caps):
            s[0] = level_at(s, cap, now) - delta
            s[1] = now

    def lower_slots(self, slots: tuple[list[float], ...], caps: tuple[float, ...], tops: tuple[float, ...],
                    now: float) -> None:
        """Bring each bucket down to at most its `top` (never up): at the start of an outage, this process's
        share of what the shared buckets held when it last saw them."""
        for s, cap, top in zip(slots, caps, tops):
            level = level_at(s, cap, now)
            s[0] = level if level < top else top
            s[1] = now
