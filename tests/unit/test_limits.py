"""Rate limits without a network: bucket maths on a clock of the test's own, header formatting, plans, settlement."""

from __future__ import annotations

import random

import pytest

from gateway.config import KeyLimits, LimitsConfig, RateLimit, ShapeConfig, StateConfig
from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.errors import GatewayError
from gateway.keys.principal import Principal
from gateway.limits.buckets import REQUESTS, TOKENS, Buckets, Need
from gateway.limits.headers import duration, duration_ms, headers, reset_text
from gateway.limits.limiter import Limiter, Reservation, build_plan, plan_lines, used_tokens
from gateway.limits.redis_buckets import SharedBuckets
from gateway.limits.resp import INCOMPLETE, ProtocolError, RespError, encode, parse
from gateway.observe.metrics import Metrics
from gateway.apis.registry import BY_NAME
from gateway.routing.shape import classify


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


async def test_the_limiter_reserves_refuses_and_settles():
    clock = Clock()
    metrics = Metrics(list)
    lim = Limiter(metrics, lambda: 1, clock=clock)
    cfg = LimitsConfig(rpm=2, tpm=1000)
    p = Principal("team", admin=False)
    needs = lim.plan(p, "m", cfg)
    assert needs is not None
    r = await lim.reserve(needs, 400, cfg)  # what it took is returned: the pipeline keeps it on the request
    h = r.headers()
    assert h["x-ratelimit-remaining-requests"] == "1" and h["x-ratelimit-remaining-tokens"] == "600"
    assert lim.unsettled == 1
    r.settle(outcome(OK, prompt=20, completion=30))
    assert lim.unsettled == 0
    r2 = await lim.reserve(needs, 100, cfg)
    assert r2.headers()["x-ratelimit-remaining-tokens"] == "850"  # 1000 - 50 used - 100 reserved
    with pytest.raises(GatewayError) as ei:
        await lim.reserve(needs, 1, cfg)
    e = ei.value
    assert (e.status, e.type, e.code) == (429, "requests", "rate_limit_exceeded")
    assert e.headers["Retry-After"] == "30" and e.headers["x-ratelimit-remaining-requests"] == "0"
    assert "team" in e.message and "Limit 2, Used 2, Requested 1" in e.message
    assert metrics._limit_refused["requests"].value == 1


async def test_a_request_larger_than_the_whole_limit_is_told_so_and_not_retried():
    lim = Limiter(Metrics(list), lambda: 1, clock=Clock())
    cfg = LimitsConfig(tpm=1000)
    p = Principal("team", admin=False)
    plan = lim.plan(p, "m", cfg)
    assert plan is not None
    with pytest.raises(GatewayError) as ei:
        await lim.reserve(plan, 1001, cfg)
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
    assert needs is not None
    for _ in range(15):
        await lim.reserve(needs, 1, cfg)
    with pytest.raises(GatewayError):
        await lim.reserve(needs, 1, cfg)
    # A request larger than the share but within the whole limit still passes once the share is full.
    lim2 = Limiter(Metrics(list), lambda: 4, clock=Clock())
    plan2 = lim2.plan(p, "m", cfg)
    assert plan2 is not None
    assert (await lim2.reserve(plan2, 80, cfg)).headers()["x-ratelimit-limit-requests"] == "15"


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
        r: Reservation | None = None
        try:
            r = lim.take(plan, tokens, clock.now)
        except GatewayError:
            pass
        refused, general_levels = general.take_slots(general_slots, plan.caps, (1, tokens), clock.now)
        assert (r is None) == (refused >= 0)
        if r is not None:
            assert list(r.levels) == general_levels
            assert r.lines == as_lines(r.headers()) == plan_lines(plan, plan.caps, general_levels)
            clock.now += rnd.choice((0.0, 0.2, 2.0))
            o = outcome(rnd.choice((OK, OK, CLIENT_LEFT, ENGINE_ERROR)), rnd.randint(0, 60), rnd.randint(0, 90))
            r.settle(o)
            general.adjust_slots(general_slots[1:], plan.caps[1:], used_tokens(o) - tokens)
        assert [s[:] for s in plan.slots] == [s[:] for s in general_slots]


def test_reset_texts_are_durations():
    assert all(reset_text(ms) == duration_ms(ms) for ms in range(-3, 130000))


def shape_of(body: dict, route: str = "chat") -> RequestShape:
    return classify(api=BY_NAME[route], body=body, session=None, principal="k", cfg=ShapeConfig(), want_prefix=False)


def test_a_request_reserves_its_prompt_once_and_its_output_for_each_choice():
    plan = build_plan("k", RateLimit(rpm=60, tpm=5000), None, None)
    ask = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 100}
    s = shape_of(ask)
    assert plan.tokens(s, ask) == s.prompt_tokens + 100
    assert plan.tokens(s, {**ask, "n": None}) == s.prompt_tokens + 100
    assert plan.tokens(s, {**ask, "n": 3}) == s.prompt_tokens + 300
    huge = {**ask, "max_tokens": 10 ** 12}  # read as asked: larger than the limit, so refused as too large
    assert plan.tokens(shape_of(huge), huge) == s.prompt_tokens + 10 ** 12
    # Without max_tokens: the expected output, for each choice too.
    bare = {"model": "m", "messages": ask["messages"], "n": 2}
    assert plan.tokens(shape_of(bare), bare) == s.prompt_tokens + 2 * ShapeConfig().default_output_tokens


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "100"), ("max_tokens", 100.0), ("max_tokens", True), ("max_tokens", -1), ("max_tokens", 0),
    ("max_completion_tokens", "lots"), ("n_predict", -1), ("max_tokens", {"x": 1}),
    ("n", "2"), ("n", 2.0), ("n", True), ("n", 0), ("n", -3),
])
def test_an_output_size_the_gateway_cannot_read_reserves_the_whole_tokens_limit(field, value):
    plan = build_plan("k", RateLimit(rpm=60, tpm=5000), "m", RateLimit(tpm=3000))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    assert plan.tokens(shape_of(body), body) == 3000  # the tightest tokens limit: passes only on a full bucket
    # Read elsewhere (a positive n_predict beside a bad max_tokens is what the shape stage goes by), or no
    # tokens limit to reserve from: the estimate.
    if field != "n":
        both = {**body, "n_predict": 7}
        assert plan.tokens(shape_of(both), both) == shape_of(both).prompt_tokens + 7
    rpm_only = build_plan("k", RateLimit(rpm=60), None, None)
    s = shape_of(body)
    assert rpm_only.tokens(s, body) == s.prompt_tokens + s.output_tokens


def test_embeddings_reserve_their_input_whatever_else_they_carry():
    plan = build_plan("k", RateLimit(tpm=5000), None, None)
    body = {"model": "m", "input": "x" * 40, "max_tokens": "n/a"}
    s = shape_of(body, "embeddings")
    assert plan.tokens(s, body) == s.prompt_tokens


class FakeShared:
    """SharedBuckets as the limiter sees it: answers as told (None: decide alone), outages counted, debts noted."""

    def __init__(self) -> None:
        self.levels: list[float] | None = None  # the levels Redis answers with; None: unusable
        self.outages = 0
        self.owed: dict[str, int] = {}
        self.settled: dict[str, int] = {}

    async def take(self, needs, costs, timeout_s, hold_s=60.0, quota_keys=(), quota_args=(), take_key=""):
        if self.levels is None:
            return None
        refused = next((i for i, (level, cost) in enumerate(zip(self.levels, costs)) if level < cost), -1)
        if refused < 0:
            self.levels = [level - cost for level, cost in zip(self.levels, costs)]
        return refused, list(self.levels)

    def down(self) -> None:
        self.levels = None
        self.outages += 1

    def owe(self, needs, costs) -> None:
        for n, c in zip(needs, costs):
            self.owed[n.name] = self.owed.get(n.name, 0) + c

    def settle(self, needs, delta) -> None:
        for n in needs:
            self.settled[n.name] = self.settled.get(n.name, 0) + delta


async def served(lim: Limiter, plan, cfg: LimitsConfig, tokens: int = 1, tries: int = 100) -> int:
    """How many of `tries` requests pass, one after another at the same instant."""
    n = 0
    for _ in range(tries):
        try:
            await lim.reserve(plan, tokens, cfg)
        except GatewayError:
            continue
        n += 1
    return n


async def test_local_buckets_carry_over_outages_and_recoveries():
    clock, shared = Clock(), FakeShared()
    lim = Limiter(Metrics(list), lambda: 2, shared, clock=clock)  # type: ignore[arg-type]
    cfg = LimitsConfig(rpm=10)
    plan = lim.plan(Principal("team", admin=False), "m", cfg)
    assert plan is not None
    shared.down()  # from the start: this process's share, 10 over 2 processes
    assert await served(lim, plan, cfg) == 5
    assert shared.owed == {plan.needs[0].name: 5}  # charged to Redis once it is back
    clock.now += 12.0  # one request back on this share (5 a minute)
    shared.levels = [10.0]  # back: the shared bucket decides
    assert await served(lim, plan, cfg, tries=3) == 3
    shared.down()  # away again: the local bucket kept its level (not refilled to full)
    assert await served(lim, plan, cfg) == 1
    for _ in range(3):  # flapping hands out nothing more
        shared.levels = [0.0]
        assert await served(lim, plan, cfg) == 0
        shared.down()
        assert await served(lim, plan, cfg) == 0
    clock.now += 12.0
    assert await served(lim, plan, cfg) == 1  # time refills it, at the share's pace


async def test_an_outage_starts_from_this_process_s_share_of_what_redis_last_held():
    clock, shared = Clock(), FakeShared()
    lim = Limiter(Metrics(list), lambda: 2, shared, clock=clock)  # type: ignore[arg-type]
    cfg = LimitsConfig(rpm=60, tpm=1000)
    plan = lim.plan(Principal("team", admin=False), "m", cfg)
    assert plan is not None
    shared.levels = [5.0, 1000.0]
    assert await served(lim, plan, cfg, tries=1) == 1  # Redis: 4 requests left for every process together
    shared.down()
    assert await served(lim, plan, cfg) == 2  # this one's half of them, not half of the whole limit


async def test_a_process_that_never_reached_redis_goes_by_the_processes_setting():
    shared = FakeShared()
    shared.down()
    lim = Limiter(Metrics(list), lambda: 1, shared, clock=Clock())  # type: ignore[arg-type]
    plan = lim.plan(Principal("team", admin=False), "m", LimitsConfig(rpm=60))
    assert plan is not None
    assert await served(lim, plan, LimitsConfig(rpm=60, processes=4)) == 15
    # A larger count seen in Redis wins over the setting.
    lim6 = Limiter(Metrics(list), lambda: 6, shared, clock=Clock())  # type: ignore[arg-type]
    plan6 = lim6.plan(Principal("team", admin=False), "m", LimitsConfig(rpm=60))
    assert plan6 is not None
    assert await served(lim6, plan6, LimitsConfig(rpm=60, processes=4)) == 10


async def test_what_a_process_took_alone_is_owed_to_redis_with_its_settlement():
    shared = FakeShared()
    shared.down()
    lim = Limiter(Metrics(list), lambda: 1, shared, clock=Clock())  # type: ignore[arg-type]
    cfg = LimitsConfig(rpm=60, tpm=1000)
    plan = lim.plan(Principal("team", admin=False), "m", cfg)
    assert plan is not None
    r = await lim.reserve(plan, 400, cfg)
    r.settle(outcome(OK, prompt=20, completion=30))  # 50 used of 400 reserved
    assert shared.owed == {plan.needs[0].name: 1, plan.needs[1].name: 50}
    assert shared.settled == {}
    shared.levels = [59.0, 1000.0]
    r = await lim.reserve(plan, 400, cfg)  # on the shared buckets: settled there, nothing owed
    r.settle(outcome(OK, prompt=20, completion=30))
    assert shared.settled == {plan.needs[1].name: -350} and shared.owed[plan.needs[1].name] == 50


async def test_what_is_owed_is_at_most_a_limit_and_waits_for_a_usable_redis():
    sb = SharedBuckets(StateConfig(backend="redis"), Metrics(list))
    needs = (Need("requests:k", REQUESTS, 10), Need("tokens:k", TOKENS, 1000))
    for _ in range(30):
        sb.owe(needs, (1, 100))
    sb.owe(needs[1:], (-300,))
    assert sb._owed == {"requests:k": [10, 10], "tokens:k": [1000, 700]}
    sb.settle(needs[1:], -5)
    await sb.flush()  # Redis unusable: settlements dropped (counted), the debt kept
    assert sb._owed == {"requests:k": [10, 10], "tokens:k": [1000, 700]}
    assert sb._pending == {} and sb.dropped == 1
