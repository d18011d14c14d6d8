"""Rate limits without a network: bucket maths on a clock of the test's own, header formatting, plans, settlement."""

from __future__ import annotations

import random

import pytest

from gateway.keys.auth import Principal
from gateway.config import KeyLimits, LimitsConfig, RateLimit
from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.errors import GatewayError
from gateway.limits.limiter import (REQUESTS, TOKENS, Buckets, Limiter, Need, build_plan, duration, duration_ms, headers,
                            plan_lines, reservation_headers, reset_text, used_tokens)
from gateway.observe.metrics import Metrics
from gateway.routing.request import RequestState
from gateway.limits.resp import INCOMPLETE, ProtocolError, RespError, encode, parse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.0004, "0s"), (0.02, "20ms"), (0.999, "999ms"), (1, "1s"), (1.5, "1.5s"), (1.25, "1.25s"),
    (59.999, "59.999s"), (60, "1m0s"), (360, "6m0s"), (61.5, "1m1.5s"), (3600, "1h0m0s"), (3723, "1h2m3s"),
])
def test_durations_are_written_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text


def take(b: Buckets, needs: tuple[Need, ...], caps: tuple[float, ...], costs: tuple[int, ...]):
    return b.take_slots(b.slots(needs), caps, costs, b.clock())  # a limiter binds the slots to its plans once


def adjust(b: Buckets, needs: tuple[Need, ...], caps: tuple[float, ...], delta: int) -> None:
    b.adjust_slots(b.slots(needs), caps, delta)


def rpm(n: int, name: str = "k") -> Need:
    return Need(f"requests:{name}", REQUESTS, n)


def tpm(n: int, name: str = "k") -> Need:
    return Need(f"tokens:{name}", TOKENS, n)


def test_sixty_requests_at_once_pass_and_the_sixty_first_does_not():
    clock = Clock()
    b = Buckets(clock)
    needs, caps = (rpm(60),), (60.0,)
    for i in range(60):
        refused, levels = take(b, needs, caps, (1,))
        assert refused == -1 and levels == [59.0 - i]
    assert take(b, needs, caps, (1,)) == (0, [0.0])
    clock.now += 0.999  # refilled at 1 request per second: not yet one whole request
    assert take(b, needs, caps, (1,))[0] == 0
    clock.now += 0.001
    assert take(b, needs, caps, (1,)) == (-1, [0.0])


@pytest.mark.parametrize("limit", [7, 13, 60, 999])
def test_the_boundary_holds_for_limits_that_do_not_divide_a_minute(limit):
    b = Buckets(Clock())
    outcomes = [take(b, (rpm(limit),), (float(limit),), (1,))[0] for _ in range(limit + 1)]
    assert outcomes == [-1] * limit + [0]


def test_a_bucket_refills_continuously_and_never_past_its_limit():
    clock = Clock()
    b = Buckets(clock)
    needs, caps = (tpm(600),), (600.0,)
    assert take(b, needs, caps, (600,)) == (-1, [0.0])
    clock.now += 30  # half a minute: half the limit back
    assert take(b, needs, caps, (301,))[0] == 0
    assert take(b, needs, caps, (300,)) == (-1, [0.0])
    clock.now += 3600
    assert take(b, needs, caps, (0,)) == (-1, [600.0])


def test_a_request_takes_from_every_bucket_or_from_none():
    b = Buckets(Clock())
    key, model = rpm(10, "key"), rpm(2, "key/m")
    caps = (10.0, 2.0)
    assert take(b, (key, model), caps, (1, 1))[0] == -1
    assert take(b, (key, model), caps, (1, 1))[0] == -1
    refused, levels = take(b, (key, model), caps, (1, 1))
    assert refused == 1 and levels == [8.0, 0.0]  # the model's bucket is empty; the key's was not charged
    assert take(b, (key,), (10.0,), (1,)) == (-1, [7.0])


def test_settlement_refunds_and_charges_tokens():
    clock = Clock()
    b = Buckets(clock)
    needs, caps = (tpm(1000),), (1000.0,)
    take(b, needs, caps, (400,))
    adjust(b, needs, caps, -350)  # reserved 400, the reply used 50
    assert take(b, needs, caps, (0,))[1] == [950.0]
    adjust(b, needs, caps, 1200)  # used far more than reserved: the bucket goes into debt
    assert take(b, needs, caps, (0,))[1] == [-250.0]
    assert take(b, needs, caps, (1,))[0] == 0
    adjust(b, needs, caps, -5000)  # a refund never fills a bucket past its limit
    assert take(b, needs, caps, (0,))[1] == [1000.0]


def test_headers_report_the_tightest_bucket_of_each_kind():
    needs = (rpm(60, "key"), tpm(90000, "key"), rpm(10, "key/m"))
    h = headers(needs, (60.0, 90000.0, 10.0), (59.0, 40000.0, 9.5))
    assert h == {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
                 "x-ratelimit-reset-requests": "3s",
                 "x-ratelimit-limit-tokens": "90000", "x-ratelimit-remaining-tokens": "40000",
                 "x-ratelimit-reset-tokens": "33.333s"}
    # Only the kinds the key is limited in; a bucket in debt shows nothing remaining.
    assert headers((tpm(60),), (60.0,), (-30.0,)) == {
        "x-ratelimit-limit-tokens": "60", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1m30s"}


def as_lines(h: dict[str, str]) -> str:
    return "".join(f"{k}: {v}\r\n" for k, v in h.items())


@pytest.mark.parametrize("limits, per_model", [(RateLimit(rpm=60, tpm=90000), None), (RateLimit(tpm=500), None),
                                               (RateLimit(rpm=60, tpm=90000), RateLimit(rpm=10))])
def test_reply_head_lines_say_what_the_headers_say(limits, per_model):
    plan = build_plan("k", limits, "m", per_model)
    for fill in (1.0, 0.98, 0.5, 0.0001, 0.0, -0.2):
        levels = [cap * fill for cap in plan.caps]
        assert plan_lines(plan, plan.caps, levels) == as_lines(headers(plan.needs, plan.caps, levels))
        share = tuple(cap / 3 for cap in plan.caps)  # this process's share: the limit text follows it
        assert plan_lines(plan, share, levels) == as_lines(headers(plan.needs, share, levels))
    common = build_plan("k", RateLimit(rpm=60, tpm=90000), None, None)
    assert plan_lines(common, (20.0, 30000.0), [19.0, 30000.0]) == (
        "x-ratelimit-limit-requests: 20\r\nx-ratelimit-remaining-requests: 19\r\nx-ratelimit-reset-requests: 3s\r\n"
        "x-ratelimit-limit-tokens: 30000\r\nx-ratelimit-remaining-tokens: 30000\r\nx-ratelimit-reset-tokens: 0s\r\n")


def test_plans_take_the_key_limits_instead_of_the_defaults_and_models_on_top():
    defaults = LimitsConfig(rpm=100, tpm=1000, models={"big": RateLimit(rpm=5)})
    lim = Limiter(Metrics(list), lambda: 1)
    anyone = Principal("anyone", admin=False)
    assert [(n.kind, n.limit, n.model) for n in lim.plan(anyone, "small", defaults).needs] == [
        (REQUESTS, 100, None), (TOKENS, 1000, None)]
    assert [(n.kind, n.limit, n.model) for n in lim.plan(anyone, "big", defaults).needs] == [
        (REQUESTS, 100, None), (TOKENS, 1000, None), (REQUESTS, 5, "big")]
    own = Principal("own", admin=False, limits=KeyLimits(tpm=50))
    assert [(n.kind, n.limit) for n in lim.plan(own, "big", defaults).needs] == [(TOKENS, 50)]
    assert lim.plan(own, "big", defaults) is lim.plan(own, "big", defaults)  # worked out once
    assert lim.plan(Principal("free", admin=False, limits=KeyLimits()), "big", defaults) is None
    assert lim.plan(anyone, "small", LimitsConfig()) is None
    # Bucket names are the key id's (never the key's) and cannot collide across id/model splits.
    a = build_plan("a:b", RateLimit(rpm=1), None, None).needs[0].name
    b = build_plan("a", RateLimit(rpm=1), "b", RateLimit(rpm=1)).needs[1].name
    assert a != b


def outcome(result: str, prompt: int = 30, completion: int = 70) -> Outcome:
    shape = RequestShape(model="m", route="chat", stream=False, prompt_tokens=10, output_tokens=5, klass="default",
                         principal="p")
    return Outcome(backend="b", shape=shape, ok=result == OK, status=200, ttft=None, itl=None, e2e=0.1,
                   prompt_tokens=prompt, completion_tokens=completion, cached_tokens=0, running_at_start=0,
                   result=result)


def test_only_served_replies_are_charged():
    assert used_tokens(outcome(OK)) == 100
    assert used_tokens(outcome(CLIENT_LEFT, completion=3)) == 33
    assert used_tokens(outcome(ENGINE_ERROR)) == 0
    assert used_tokens(outcome(CLIENT_ERROR)) == 0
    assert used_tokens(None) == 0


def request(principal: Principal) -> RequestState:
    st = RequestState("req", None, "chat")  # type: ignore[arg-type]  # no server: the limiter never replies
    st.principal = principal
    return st


async def test_the_limiter_reserves_refuses_and_settles():
    clock = Clock()
    metrics = Metrics(list)
    lim = Limiter(metrics, lambda: 1, clock=clock)
    cfg = LimitsConfig(rpm=2, tpm=1000)
    p = Principal("team", admin=False)
    needs = lim.plan(p, "m", cfg)
    st = request(p)
    await lim.reserve(st, needs, 400, cfg)
    assert st.limit is not None
    h = reservation_headers(st.limit)
    assert h["x-ratelimit-remaining-requests"] == "1" and h["x-ratelimit-remaining-tokens"] == "600"
    st.outcome = outcome(OK, prompt=20, completion=30)
    lim.settle(st, st.limit)
    assert lim.unsettled == 0 and st.limit is None
    st2 = request(p)
    await lim.reserve(st2, needs, 100, cfg)
    assert st2.limit is not None and reservation_headers(st2.limit)["x-ratelimit-remaining-tokens"] == "850"  # 1000 - 50 used - 100 reserved
    with pytest.raises(GatewayError) as ei:
        await lim.reserve(request(p), needs, 1, cfg)
    e = ei.value
    assert (e.status, e.type, e.code) == (429, "requests", "rate_limit_exceeded")
    assert e.headers["Retry-After"] == "30" and e.headers["x-ratelimit-remaining-requests"] == "0"
    assert "team" in e.message and "Limit 2, Used 2, Requested 1" in e.message
    assert metrics._limit_refused["requests"].value == 1


async def test_a_request_larger_than_the_whole_limit_is_told_so_and_not_retried():
    lim = Limiter(Metrics(list), lambda: 1, clock=Clock())
    cfg = LimitsConfig(tpm=1000)
    p = Principal("team", admin=False)
    with pytest.raises(GatewayError) as ei:
        await lim.reserve(request(p), lim.plan(p, "m", cfg), 1001, cfg)
    e = ei.value
    assert (e.status, e.type, e.code) == (429, "tokens", "rate_limit_exceeded")
    assert "Request too large" in e.message and "1001" in e.message and "1000 tokens per minute" in e.message
    assert e.headers["x-should-retry"] == "false" and "Retry-After" not in e.headers
    assert e.headers["x-ratelimit-remaining-tokens"] == "1000"  # nothing was taken


async def test_each_process_holds_its_share_of_a_limit():
    lim = Limiter(Metrics(list), lambda: 4, clock=Clock())
    cfg = LimitsConfig(rpm=60, tpm=100)
    p = Principal("team", admin=False)
    needs = lim.plan(p, "m", cfg)
    for _ in range(15):
        await lim.reserve(request(p), needs, 1, cfg)
    with pytest.raises(GatewayError):
        await lim.reserve(request(p), needs, 1, cfg)
    # A request larger than the share but within the whole limit still passes once the share is full.
    lim2 = Limiter(Metrics(list), lambda: 4, clock=Clock())
    st = request(p)
    await lim2.reserve(st, lim2.plan(p, "m", cfg), 80, cfg)
    assert st.limit is not None and reservation_headers(st.limit)["x-ratelimit-limit-requests"] == "15"


@pytest.mark.parametrize("data, value", [
    (b"+PONG\r\n", "PONG"), (b":42\r\n", 42), (b"$3\r\nabc\r\n", b"abc"), (b"$-1\r\n", None), (b"*-1\r\n", None),
    (b"*3\r\n:1\r\n$4\r\n59.5\r\n$0\r\n\r\n", [1, b"59.5", b""]), (b"*2\r\n*1\r\n:1\r\n+x\r\n", [[1], "x"]),
])
def test_redis_replies_are_read_whole_or_not_at_all(data, value):
    assert parse(bytearray(data), 0) == (value, len(data))
    for cut in range(len(data)):  # any prefix of a reply is not a reply yet
        assert parse(bytearray(data[:cut]), 0)[0] is INCOMPLETE


def test_redis_errors_and_garbage():
    err, end = parse(bytearray(b"-NOSCRIPT No matching script\r\n"), 0)
    assert isinstance(err, RespError) and str(err).startswith("NOSCRIPT") and end == 30
    with pytest.raises(ProtocolError):
        parse(bytearray(b"HTTP/1.1 200 OK\r\n"), 0)
    with pytest.raises(ProtocolError):
        parse(bytearray(b":4x\r\n"), 0)
    assert encode(("EVALSHA", "ab", 1, "k", 60)) == b"*5\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$1\r\nk\r\n$2\r\n60\r\n"


def test_the_unrolled_usual_plan_decides_and_settles_as_the_general_path():
    """Limiter.take's path for a requests and a tokens bucket at whole limits against the general bucket code:
    the same decisions, levels, bucket state and settlements, and reply-head lines that say what its headers say."""
    rnd = random.Random(7)
    clock = Clock()
    lim, general = Limiter(Metrics(list), lambda: 1, clock=clock), Buckets(clock)
    p = Principal("k", admin=False)
    plan = lim.plan(p, "m", LimitsConfig(rpm=5, tpm=300))
    assert plan is not None and plan.common
    general_slots = general.slots(plan.needs)
    for _ in range(500):
        clock.now += rnd.choice((0.0, 0.05, 0.5, 3.0))
        tokens = rnd.randint(0, 120)
        st = request(p)
        try:
            lim.take(st, plan, tokens, clock.now)
        except GatewayError:
            pass
        refused, general_levels = general.take_slots(general_slots, plan.caps, (1, tokens), clock.now)
        assert (st.limit is None) == (refused >= 0)
        if st.limit is not None:
            assert list(st.limit[2]) == general_levels
            assert st.limit_lines == as_lines(reservation_headers(st.limit)) == plan_lines(plan, plan.caps, general_levels)
            clock.now += rnd.choice((0.0, 0.2, 2.0))
            st.outcome = outcome(rnd.choice((OK, OK, CLIENT_LEFT, ENGINE_ERROR)), rnd.randint(0, 60), rnd.randint(0, 90))
            lim.settle(st, st.limit)
            general.adjust_slots(general_slots[1:], plan.caps[1:], used_tokens(st.outcome) - tokens)
        assert [s[:] for s in plan.slots] == [s[:] for s in general_slots]


def test_reset_texts_are_durations():
    assert all(reset_text(ms) == duration_ms(ms) for ms in range(-3, 130000))
