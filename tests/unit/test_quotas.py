"""Token quotas without a network: UTC periods and their ends, the check and its 429, settlement, workers' and
outages' shares, and a new period starting from nothing."""

from __future__ import annotations

import calendar

import pytest

from gateway.config import KeyLimits, LimitsConfig, RateLimit, parse_config
from gateway.contracts import Outcome, RequestShape
from gateway.errors import GatewayError
from gateway.keys.principal import Principal
from gateway.limits.limiter import Limiter
from gateway.limits.quotas import DAY, MONTH, Periods, day_number, month_number, period_end, period_text
from gateway.observe.metrics import Metrics
from gateway.runtime import build_policy


def utc(*ymd_hms: int) -> float:
    return float(calendar.timegm((*ymd_hms, 0, 0, 0)[:6] + (0, 0, 0)))


class Wall:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_days_and_months_end_at_midnight_utc():
    t = utc(2026, 12, 31, 23, 59, 59)
    assert period_end(DAY, day_number(t)) == utc(2027, 1, 1, 0, 0, 0)
    assert period_end(MONTH, month_number(t)) == utc(2027, 1, 1, 0, 0, 0)
    assert period_text(DAY, day_number(t)) == "2026-12-31" and period_text(MONTH, month_number(t)) == "2026-12"
    leap = utc(2028, 2, 10, 12, 0, 0)
    assert period_end(MONTH, month_number(leap)) == utc(2028, 3, 1, 0, 0, 0)
    assert period_text(MONTH, month_number(utc(2027, 1, 1, 0, 0, 0))) == "2027-01"
    # The first instant of a day is in it, the last before midnight in the one before.
    assert day_number(utc(2026, 12, 6, 0, 0, 0)) == day_number(utc(2026, 12, 5, 23, 59, 59)) + 1


def test_periods_move_on_when_one_ends():
    wall = Wall(utc(2026, 12, 31, 23, 59, 59))
    p = Periods(wall)
    p.now()
    assert p.texts == {DAY: "2026-12-31", MONTH: "2026-12"}
    wall.t += 1
    p.now()
    assert p.texts == {DAY: "2027-01-01", MONTH: "2027-01"} and p.ends[DAY] == utc(2027, 1, 2, 0, 0, 0)


def shape(prompt: int, output: int) -> RequestShape:
    return RequestShape(model="m", route="chat", stream=False, prompt_tokens=prompt, output_tokens=output,
                        klass="default")


def served(prompt: int, completion: int) -> Outcome:
    return Outcome("b", shape(prompt, completion), ok=True, status=200, ttft=None, itl=None, e2e=0.1,
                   prompt_tokens=prompt, completion_tokens=completion)


def limiter(wall: Wall, share: int = 1) -> Limiter:
    return Limiter(Metrics(list), lambda: share, wall=wall)


def test_a_day_quota_refuses_what_does_not_fit_until_midnight_utc():
    wall = Wall(utc(2026, 12, 5, 23, 0, 0))
    lim = limiter(wall)
    key = Principal("team", admin=False, limits=KeyLimits(tokens_per_day=100))
    plan = lim.plan(key, "m", LimitsConfig())
    assert plan is not None and plan.needs == ()  # quotas alone: no minute bucket
    held = [lim.take(plan, 30, 0.0) for _ in range(3)]  # 90 reserved
    assert held[0].headers()["x-ratelimit-limit-tokens-day"] == "100"
    assert held[-1].headers()["x-ratelimit-remaining-tokens-day"] == "10"
    assert held[-1].headers()["x-ratelimit-reset-tokens-day"] == "1h0m0s"
    with pytest.raises(GatewayError) as e:
        lim.take(plan, 30, 0.0)
    err = e.value
    assert err.status == 429 and err.code == "quota_exceeded" and err.type == "tokens"
    assert err.headers["Retry-After"] == "120"  # an hour to go, capped as every Retry-After
    assert err.headers["x-ratelimit-reset-tokens-day"] == "1h0m0s"
    assert "2026-12-06T00:00:00Z" in err.message and "Used 90" in err.message
    # Settled from usage: each used 10 of its 30, so 60 come back and the next fits.
    for h in held:
        h.settle(served(5, 5))
    assert lim.take(plan, 30, 0.0).headers()["x-ratelimit-remaining-tokens-day"] == "40"
    wall.t = utc(2026, 12, 6, 0, 0, 0)  # midnight UTC: a new day, nothing used
    assert lim.take(plan, 100, 0.0).headers()["x-ratelimit-remaining-tokens-day"] == "0"


def test_a_request_larger_than_the_quota_is_told_not_to_retry():
    lim = limiter(Wall(utc(2026, 12, 5, 12, 0, 0)))
    plan = lim.plan(Principal("team", admin=False, limits=KeyLimits(tokens_per_month=50)), "m", LimitsConfig())
    assert plan is not None
    with pytest.raises(GatewayError) as e:
        lim.take(plan, 51, 0.0)
    assert e.value.headers["x-should-retry"] == "false" and "Retry-After" not in e.value.headers
    assert lim.take(plan, 50, 0.0).headers()["x-ratelimit-reset-tokens-month"] == "636h0m0s"  # 26.5 days to January 1st


def test_a_model_quota_on_top_of_the_key_s_and_the_minute_limits():
    lim = limiter(Wall(utc(2026, 12, 5, 12, 0, 0)))
    limits = KeyLimits(rpm=100, tokens_per_day=1000, models={"m": RateLimit(tokens_per_day=100)})
    key = Principal("team", admin=False, limits=limits)
    m, other = lim.plan(key, "m", LimitsConfig()), lim.plan(key, "other", LimitsConfig())
    assert m is not None and other is not None
    lim.take(m, 100, 0.0)
    with pytest.raises(GatewayError) as e:
        lim.take(m, 1, 0.0)
    assert "for model `m`" in e.value.message
    for _ in range(9):  # the key's own quota: 1000, of which m took 100
        lim.take(other, 100, 0.0)
    with pytest.raises(GatewayError):
        lim.take(other, 1, 0.0)


def test_workers_without_a_shared_store_hold_their_share():
    lim = limiter(Wall(utc(2026, 12, 5, 12, 0, 0)), share=4)
    plan = lim.plan(Principal("team", admin=False, limits=KeyLimits(tokens_per_day=100)), "m", LimitsConfig())
    assert plan is not None
    for _ in range(5):
        lim.take(plan, 5, 0.0)
    with pytest.raises(GatewayError) as e:
        lim.take(plan, 1, 0.0)
    assert "this process's share" in e.value.message


def test_refunds_never_take_a_quota_below_zero_nor_charge_a_period_that_ended():
    wall = Wall(utc(2026, 12, 5, 23, 59, 0))
    lim = limiter(wall)
    plan = lim.plan(Principal("team", admin=False, limits=KeyLimits(tokens_per_day=100)), "m", LimitsConfig())
    assert plan is not None
    held = lim.take(plan, 80, 0.0)
    wall.t += 120  # the request ends in the next day: its usage belongs to the day it was taken in
    held.settle(served(100, 100))
    assert lim.take(plan, 100, 0.0).headers()["x-ratelimit-remaining-tokens-day"] == "0"


def test_quotas_are_checked_in_the_configuration():
    backends = [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}]
    for bad in ({"tokens_per_day": 0}, {"tokens_per_month": 10 ** 16}):
        with pytest.raises(Exception, match="tokens_per"):
            parse_config({"auth": {"enabled": False}, "backends": backends, "limits": bad}, build_policy)
    cfg = parse_config({"auth": {"enabled": False}, "backends": backends,
                        "limits": {"tokens_per_day": 5, "models": {"m": {"tokens_per_month": 7}}}}, build_policy)
    assert cfg.limits.tokens_per_day == 5 and cfg.limits.models["m"].tokens_per_month == 7


class FakeShared:
    """SharedBuckets as the limiter sees it for quotas: a store of used tokens by key, or down (None)."""

    prefix = "p:"

    def __init__(self) -> None:
        self.used: dict[str, float] | None = {}
        self.outages = 0
        self.charged: dict[str, int] = {}

    uncertain = False  # the store was known down: nothing was sent

    def settled(self) -> bool:
        return True

    def take_key(self) -> str:
        return "p:quota-take:1"

    async def take(self, needs, costs, timeout_s, hold_s=60.0, quota_keys=(), quota_args=(), take_key=""):
        if self.used is None:
            return None
        args = [quota_args[i:i + 5] for i in range(0, len(quota_args), 5)]
        now = [self.used.get(k, floor) for k, (_, _, floor, _, _) in zip(quota_keys, args)]
        refused = next((len(needs) + j for j, (u, (q, c, _, _, unsent)) in enumerate(zip(now, args))
                        if u + c + unsent > q), -1)
        if refused < 0:
            for k, u, (_, c, _, _, _) in zip(quota_keys, now, args):
                self.used[k] = u + c
        return refused, [self.used.get(k, u) for k, u in zip(quota_keys, now)]

    def down(self) -> None:
        self.used = None
        self.outages += 1

    def owe(self, needs, costs) -> None:
        pass

    def settle(self, needs, delta) -> None:
        pass

    def charge_quotas(self, keys, needs, slots, periods, delta) -> None:
        for k, s, p in zip(keys, slots, periods):
            self.charged[k] = self.charged.get(k, 0) + delta
            s.unsent += delta


async def test_an_outage_splits_what_was_left_of_a_quota_and_owes_what_it_took():
    shared = FakeShared()
    lim = Limiter(Metrics(list), lambda: 2, shared, wall=Wall(utc(2026, 12, 5, 12, 0, 0)))  # type: ignore[arg-type]
    cfg = LimitsConfig(tokens_per_day=100)
    plan = lim.plan(Principal("team", admin=False), "m", cfg)
    assert plan is not None
    for _ in range(4):
        await lim.reserve(plan, 10, cfg)  # through the shared store: 40 used by everyone
    key = "p:quota:tokens-day:4:team:2026-12-05"
    assert shared.used == {key: 40}
    shared.down()  # this process's half of the 60 left
    for _ in range(3):
        await lim.reserve(plan, 10, cfg)
    with pytest.raises(GatewayError) as e:
        await lim.reserve(plan, 10, cfg)
    assert e.value.code == "quota_exceeded" and "share" in e.value.message
    assert shared.charged == {key: 30}  # what it took alone, owed to the shared store
    # The floor it passes is what it knew the store held, less its own charges not sent yet.
    shared.used = {}  # back, but the key vanished
    with pytest.raises(GatewayError):
        await lim.reserve(plan, 31, cfg)  # 40 known + 30 owed: 30 left
    held = await lim.reserve(plan, 30, cfg)
    assert shared.used == {key: 70} and held.headers()["x-ratelimit-remaining-tokens-day"] == "0"
