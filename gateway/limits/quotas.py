"""Token quotas per key (and per key and model) per UTC day and month: periods, this process's view of each
quota, its x-ratelimit lines and its 429."""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.errors import GatewayError, retry_after_header
from gateway.limits.headers import duration_ms

# Why fixed periods and not buckets: a quota is a budget ("a million tokens a day"), read against an invoice's
# calendar, so it resets at 00:00 UTC (a day) and on the 1st at 00:00 UTC (a month), the same instant for every
# replica whatever its time zone. Its state is one number per quota and period: the tokens used, which only the
# request path's reservations and their settlements move. A request reserves its estimate as for the minute limits
# (a request whose reservation does not fit what is left is refused) and is settled from its usage.
DAY: Final = "day"
MONTH: Final = "month"
PERIODS: Final = (DAY, MONTH)
WallClock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class QuotaNeed:
    """One quota a request draws from: its name (kind, key id, model; never the key, nor the period), the
    period it counts over (DAY or MONTH) and its tokens."""

    name: str
    period: str
    limit: int
    model: str | None = None


def quota_name(period: str, principal: str, model: str | None) -> str:
    # The id's length first, as for buckets, so that no key id and model pair can spell another pair's name.
    return f"quota:tokens-{period}:{len(principal)}:{principal}" + (f":{model}" if model is not None else "")


def day_number(now_wall: float) -> int:
    """Days since 1970-01-01 UTC."""
    return int(now_wall // 86400)


def month_number(now_wall: float) -> int:
    """Months since 0000-01: year * 12 + month - 1, in UTC."""
    t = time.gmtime(now_wall)
    return t.tm_year * 12 + t.tm_mon - 1


def period_end(period: str, number: int) -> float:
    """The wall time (UTC) at which period `number` of its kind ends and the next begins."""
    if period == DAY:
        return (number + 1) * 86400.0
    year, month = divmod(number + 1, 12)
    return float(calendar.timegm((year, month + 1, 1, 0, 0, 0, 0, 0, 0)))


def period_text(period: str, number: int) -> str:
    """A period as it shows in a Redis key: 2026-12-05 for a day, 2026-12 for a month."""
    if period == DAY:
        return time.strftime("%Y-%m-%d", time.gmtime(number * 86400))
    year, month = divmod(number, 12)
    return f"{year:04d}-{month + 1:02d}"


class Periods:
    """The current day and month and when each ends, worked out again only when one has ended (a comparison per
    request otherwise)."""

    def __init__(self, clock: WallClock = time.time) -> None:
        self.clock = clock
        self.numbers: dict[str, int] = {}
        self.ends: dict[str, float] = {}
        self.texts: dict[str, str] = {}
        self._until = -math.inf

    def now(self) -> float:
        """The wall clock, with the periods brought up to date."""
        now = self.clock()
        if now >= self._until:
            for period in PERIODS:
                n = day_number(now) if period == DAY else month_number(now)
                self.numbers[period], self.ends[period] = n, period_end(period, n)
                self.texts[period] = period_text(period, n)
            self._until = min(self.ends.values())
        return now


class QuotaSlot:
    """This process's view of one quota in the current period. `used`: the tokens used as this process knows them
    (what the shared store last said, plus what this process charged and has not sent yet: `unsent`); `base`:
    `used` when it last began deciding alone (it splits what was left then); `outage`: the outage it decides
    alone in; `fresh`: whether the shared store answered for it since `base` was taken."""

    __slots__ = ("period", "used", "unsent", "base", "outage", "fresh")

    def __init__(self, period: int) -> None:
        self.period = period
        self.used = 0.0
        self.unsent = 0.0
        self.base = 0.0
        self.outage = 0
        self.fresh = False

    def current(self, period: int) -> QuotaSlot:
        """Itself, started again when a new period has begun (what was sent for the last one stays sent)."""
        if self.period != period:
            self.period, self.used, self.unsent, self.base, self.outage, self.fresh = period, 0.0, 0.0, 0.0, 0, False
        return self

    def heard(self, used: float, settled: bool = True) -> None:
        """What the shared store says it holds (this process's unsent charges come on top). `settled`: whether
        it holds what every process took alone in the last outage too; only then is what it says new enough to
        split again."""
        self.used = used + self.unsent
        self.fresh = self.fresh or settled

    def alone(self, outage: int) -> None:
        """Deciding alone in `outage`: what is left is split from what the shared store last said, once per thing
        it said. An outage after one in which it said nothing new keeps the split it had (else each outage would
        hand out a share of what is left again, what the other processes took alone unknown, a flapping store
        adding up to the whole quota for each process)."""
        if self.outage != outage:
            if self.fresh or self.outage == 0:
                self.base, self.fresh = self.used, False
            self.outage = outage


class Quotas:
    """The quota slots of one process by quota name; with the shared store also what must still be sent there."""

    def __init__(self, clock: WallClock = time.time) -> None:
        self.periods = Periods(clock)
        self._slots: dict[str, tuple[QuotaNeed, QuotaSlot]] = {}
        self._resets: dict[str, tuple[int, str]] = {}  # period -> (seconds to its end, their text)

    def slots(self, needs: tuple[QuotaNeed, ...]) -> tuple[QuotaSlot, ...]:
        self.periods.now()
        out = []
        for n in needs:
            known = self._slots.get(n.name)
            if known is None:
                known = self._slots[n.name] = (n, QuotaSlot(self.periods.numbers[n.period]))
            out.append(known[1])
        return tuple(out)

    def known(self) -> list[tuple[QuotaNeed, QuotaSlot]]:
        """Every quota this process has seen used in its current period (what it can tell a Redis that lost
        them: SharedBuckets.restore)."""
        self.periods.now()
        return [(n, s) for n, s in self._slots.values() if s.period == self.periods.numbers[n.period] and s.used > 0]

    def used(self, need: QuotaNeed, period: int) -> float:
        """The tokens of `need` used in `period` as this process knows them (0: none it knows of)."""
        known = self._slots.get(need.name)
        return known[1].used if known is not None and known[1].period == period else 0.0

    def check(self, principal: str, needs: tuple[QuotaNeed, ...], slots: tuple[QuotaSlot, ...], cost: int,
              share: int, outage: int, headers: Callable[[], dict[str, str]]) -> tuple[QuotaSlot, ...]:
        """`slots`, in the current periods, if each quota has room for `cost` more tokens (not charged yet), else
        the 429 of the first without. `share`: how many processes split what is left (1: the whole quota);
        `outage`: the outage this process decides alone in (0: none; see QuotaSlot.alone). One pass, per request."""
        p = self.periods
        p.now()
        numbers = p.numbers
        for n, s in zip(needs, slots):
            if s.period != numbers[n.period]:
                s.current(numbers[n.period])
            if s.outage != outage:
                s.alone(outage)
            room = (n.limit - s.base) / share if share > 1 else n.limit - s.base
            if s.used - s.base + cost > room:
                raise quota_refusal(principal, n, room + s.base, s.used, cost, p.ends[n.period], p.clock(),
                                    headers())
        return slots

    def lines(self, q: PlanQuotas, slots: Sequence[QuotaSlot]) -> str:
        """quota_lines() for a plan's quotas, the reset texts made once a second (a period ends in hours: whole
        seconds say enough) and each quota's head text made once."""
        p = self.periods
        now = p.now()
        if not q.one_per_period:
            return quota_lines(q.needs, slots, p.ends, now)
        out = ""
        for n, s, head, tail in zip(q.needs, slots, q.heads, q.tails):
            left = n.limit - s.used
            out += f"{head}{math.floor(left) if left > 0 else 0}{tail}{self._reset(n.period, now)}\r\n"
        return out

    def _reset(self, period: str, now: float) -> str:
        left = int(self.periods.ends[period] - now)
        known = self._resets.get(period)
        if known is None or known[0] != left:
            known = self._resets[period] = (left, reset_text(left))
        return known[1]


def shortest(needs: Sequence[QuotaNeed], slots: Sequence[QuotaSlot], caps: Sequence[float], base: Sequence[float],
             cost: int) -> int:
    """The first quota without room for `cost` tokens (-1: all have room). A quota's room: its cap (the limit, or
    this process's share of what was left at `base`) less what was used since `base`."""
    for i, s in enumerate(slots):
        if s.used - base[i] + cost > caps[i]:
            return i
    return -1


# -- headers and the 429 ------------------------------------------------------------------------------------
QUOTA_HEADERS: Final = {period: (f"x-ratelimit-limit-tokens-{period}", f"x-ratelimit-remaining-tokens-{period}",
                                 f"x-ratelimit-reset-tokens-{period}") for period in PERIODS}


def reset_text(seconds: int) -> str:
    """Whole seconds as OpenAI's reset headers write a duration: 45s, 6m0s, 13h2m5s."""
    return duration_ms(max(seconds, 0) * 1000)


def quota_lines(needs: Sequence[QuotaNeed], slots: Sequence[QuotaSlot], ends: dict[str, float], now: float) -> str:
    """The x-ratelimit-*-tokens-{day,month} triple of each period the key has a quota in, from its tightest
    quota (the least remaining), as reply-head lines; reset: the time until the period ends."""
    best: dict[str, tuple[float, int]] = {}
    for n, s in zip(needs, slots):
        left = n.limit - s.used
        if n.period not in best or left < best[n.period][0]:
            best[n.period] = (left, n.limit)
    out = ""
    for period, (left, limit) in best.items():
        a, b, c = QUOTA_HEADERS[period]
        out += (f"{a}: {limit}\r\n{b}: {max(math.floor(left), 0)}\r\n"
                f"{c}: {reset_text(int(ends[period] - now))}\r\n")
    return out


def quota_refusal(principal: str, need: QuotaNeed, cap: float, used: float, cost: int, end: float, now: float,
                  headers: dict[str, str]) -> GatewayError:
    """The 429 of a quota that ran out: when it resets, in the message and the headers, and Retry-After (capped
    as every Retry-After of the gateway is: a client polls rather than sleeps for hours). A request larger than
    the whole quota can never pass: it says so, and SDKs are told not to retry."""
    where = f" for model `{need.model}`" if need.model else ""
    h = dict(headers)
    if cost > need.limit:
        h["x-should-retry"] = "false"
        return GatewayError(429, f"Request too large for the {need.period}ly token quota of key `{principal}`{where}: "
                            f"it needs about {cost} tokens, more than the quota of {need.limit}. Shorten the prompt "
                            f"or lower max_tokens (or n).", type="tokens", code="quota_exceeded", headers=h)
    h["Retry-After"] = retry_after_header(end - now)
    resets = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(end))
    share = "" if cap >= need.limit else f" (this process's share while the shared store is unusable: {math.floor(cap)})"
    return GatewayError(429, f"Token quota reached for key `{principal}`{where} on tokens per {need.period}: Limit "
                        f"{need.limit}{share}, Used {max(math.ceil(used), 0)}, Requested {cost}. It resets at "
                        f"{resets} (UTC).", type="tokens", code="quota_exceeded", headers=h)


class PlanQuotas:
    """The quotas one key's requests for one model draw from (the key's, then the model's), their slots in this
    process, and their names in the shared store for the current periods (made again only when one ends)."""

    __slots__ = ("needs", "slots", "keys", "keys_at", "one_per_period", "heads", "tails")

    def __init__(self, needs: tuple[QuotaNeed, ...]) -> None:
        self.needs = needs
        self.slots: tuple[QuotaSlot, ...] = ()
        # Without per-model quotas each period has one quota: its header lines need no search for the tightest,
        # and their fixed parts are made here once.
        self.one_per_period = len({n.period for n in needs}) == len(needs)
        self.heads = tuple([f"{QUOTA_HEADERS[n.period][0]}: {n.limit}\r\n{QUOTA_HEADERS[n.period][1]}: "
                            for n in needs])
        self.tails = tuple([f"\r\n{QUOTA_HEADERS[n.period][2]}: " for n in needs])
        self.keys: tuple[str, ...] = ()
        self.keys_at: tuple[int, ...] = ()

    def bind(self, quotas: Quotas) -> PlanQuotas:
        self.slots = quotas.slots(self.needs)
        return self

    def store_keys(self, prefix: str, periods: Periods) -> tuple[str, ...]:
        """Each quota's key in the shared store for its current period: prefix, name, period (2026-12-05)."""
        at = tuple([periods.numbers[n.period] for n in self.needs])
        if at != self.keys_at:
            self.keys = tuple([f"{prefix}{n.name}:{periods.texts[n.period]}" for n in self.needs])
            self.keys_at = at
        return self.keys


def build_quotas(principal: str, scopes: Sequence[tuple[int | None, int | None, str | None]]) -> PlanQuotas | None:
    """A plan's quotas from (tokens per day, tokens per month, model) of each scope (the key's, then a model's)."""
    needs = []
    for day, month, model in scopes:
        for period, limit in ((DAY, day), (MONTH, month)):
            if limit is not None:
                needs.append(QuotaNeed(quota_name(period, principal, model), period, limit, model))
    return PlanQuotas(tuple(needs)) if needs else None


def expire_ms(period: str, number: int) -> int:
    """When a quota's key in the shared store may go: a day after its period ended (so a listing just after
    midnight still finds the day that ended), as Unix time in ms."""
    return int((period_end(period, number) + 86400.0) * 1000)


def report_row(need: QuotaNeed, used: float, periods: Periods) -> dict[str, object]:
    """One quota as the key listings show it: period, model (None: the key's own), tokens, used, and when it
    resets (UTC, ISO 8601)."""
    return {"period": need.period, "model": need.model, "limit": need.limit, "used": max(math.floor(used), 0),
            "resets": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(periods.ends[need.period]))}
