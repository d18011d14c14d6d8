"""Per-key rate limits through the official openai client: 429s, x-ratelimit headers, tokens settled from usage."""

from __future__ import annotations

import asyncio
import math
import secrets
import time

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as redis_asyncio

from gateway.config import ShapeConfig, StateConfig
from gateway.keys.principal import hash_key
from gateway.limits.buckets import REQUESTS, Need
from gateway.limits.redis_buckets import SharedBuckets
from gateway.observe.metrics import Metrics
from gateway.apis.chat import CHAT
from gateway.routing.shape import classify
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.integration.test_metrics import scrape
from tests.needs import REDIS_URL, redis_up, skip_or_fail

HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
           "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def config(engines: list[FakeEngine], user: dict | None = None, **sections) -> dict:
    """`user`: the user key's own limits (else the [limits] defaults); the ops key has none at all."""
    keys = [{"id": "user", "sha256": hash_key(USER_KEY), **({"limits": user} if user is not None else {})},
            {"id": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True, "limits": {}}]
    backends = [{"id": "good", "engine": "vllm", "url": engines[0].url, "models": ["m1", "m2"]}]
    if len(engines) > 1:
        backends.append({"id": "bad", "engine": "vllm", "url": engines[1].url, "models": ["broken"]})
    return gateway_config(backends, auth={"keys": keys}, **sections)


def client(url: str, key: str = USER_KEY, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=retries)


def ask(content: str = "hi", **kw) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": content}], **kw}


def reserved(body: dict) -> int:
    """What the gateway reserves for `body`: its prompt estimate and max_tokens (the same pure function it uses)."""
    s = classify(api=CHAT, body=body, session=None, principal="user", cfg=ShapeConfig(), want_prefix=False)
    return s.prompt_tokens + s.output_tokens


@pytest.fixture
async def engines():
    started = [await FakeEngine(Knobs()).start(), await FakeEngine(Knobs(fail_status=400)).start()]
    yield started
    for e in started:
        await e.stop()


async def test_success_stream_and_error_replies_carry_the_headers_and_refusals_are_openai_429s(engines):
    gw = await start_gateway(config(engines, limits={"rpm": 4, "tpm": 100_000}))
    try:
        async with client(gw.url) as c:
            raw = await c.chat.completions.with_raw_response.create(**ask(max_tokens=5))
            h = raw.headers
            need = reserved(ask(max_tokens=5))
            assert [h[k] for k in HEADERS] == ["4", "3", "15s", "100000", str(100_000 - need), f"{need * 60 // 100}ms"]
            assert raw.parse().choices[0].message.content == "w0 w1 w2 w3 w4"
            raw = await c.chat.completions.with_raw_response.create(**ask(max_tokens=5), stream=True)
            assert raw.headers["x-ratelimit-remaining-requests"] == "2"
            assert raw.headers["content-type"].startswith("text/event-stream")
            assert [ch async for ch in raw.parse()]
            with pytest.raises(openai.BadRequestError) as ei:  # the engine's error, relayed with the headers
                await c.chat.completions.create(model="broken", messages=[{"role": "user", "content": "x"}])
            assert ei.value.response.headers["x-ratelimit-remaining-requests"] == "1"
            await c.chat.completions.create(**ask(max_tokens=1))
            with pytest.raises(openai.RateLimitError) as ei:
                await c.chat.completions.create(**ask(max_tokens=1))
            r = ei.value.response
            assert r.status_code == 429 and r.headers["x-ratelimit-remaining-requests"] == "0"
            assert 1 <= int(r.headers["Retry-After"]) <= 15 and "x-ratelimit-limit-tokens" in r.headers
            err = orjson.loads(r.content)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["type"], err["code"], err["param"]) == ("requests", "rate_limit_exceeded", None)
            assert "Limit 4, Used 4, Requested 1" in err["message"] and USER_KEY not in err["message"]
            assert r.headers["x-request-id"]
        # A key with no limit at all: served, and no header says anything about limits.
        async with client(gw.url, ADMIN_KEY) as c:
            raw = await c.chat.completions.with_raw_response.create(**ask(max_tokens=1))
            assert not [k for k in raw.headers if k.startswith("x-ratelimit")]
        m = await scrape(gw.url)
        assert m.one("shapegate_ratelimit_refused_total", kind="requests") == 1
        assert m.one("shapegate_ratelimit_refused_total", kind="tokens") == 0
        assert m.value("shapegate_requests_total", status="429", outcome="rejected") == 1
        assert gw.state.limiter.unsettled == 0  # every request that took something was settled
    finally:
        await gw.stop()


async def test_per_model_limits_apply_on_top_of_the_key_s_own(engines):
    user = {"rpm": 50, "models": {"m2": {"rpm": 1}}}
    gw = await start_gateway(config(engines, user=user, limits={"rpm": 1}))  # the key's own replace these
    try:
        async with client(gw.url) as c:
            raw = await c.chat.completions.with_raw_response.create(model="m2", messages=[{"role": "user",
                                                                                           "content": "x"}])
            assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == \
                ("1", "0")  # the tighter of the key's (49 left) and the model's
            assert "x-ratelimit-limit-tokens" not in raw.headers  # no tokens limit anywhere
            with pytest.raises(openai.RateLimitError) as ei:
                await c.chat.completions.create(model="m2", messages=[{"role": "user", "content": "x"}])
            assert "for model `m2`" in ei.value.message
            for left in (48, 47):  # another model only has the key's own limit (the defaults' rpm=1 is replaced)
                raw = await c.chat.completions.with_raw_response.create(**ask())
                assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
    finally:
        await gw.stop()


async def remaining_tokens(c: openai.AsyncOpenAI, **kw) -> tuple[int, float]:
    raw = await c.chat.completions.with_raw_response.create(**kw)
    if kw.get("stream"):
        async for _ in raw.parse():
            pass
    return int(raw.headers["x-ratelimit-remaining-tokens"]), time.monotonic()


async def test_tokens_are_reserved_from_the_estimate_and_settled_from_usage(engines):
    # A prompt estimated at about 200 tokens that the engine counts as 10: each reply refunds the difference.
    prompt = "x" * 808
    tpm = 600  # refills 10 tokens a second: the bounds below allow for what came back meanwhile
    gw = await start_gateway(config(engines, user={"tpm": tpm}))
    try:
        async with client(gw.url) as c:
            reserve = reserved(ask(prompt, max_tokens=5))
            assert reserve > 200
            first, t0 = await remaining_tokens(c, **ask(prompt, max_tokens=5))
            assert first == tpm - reserve
            # Settled: 15 used (10 + 5) instead of `reserve`; the next one reserves as much again.
            second, t1 = await remaining_tokens(c, **ask(prompt, max_tokens=5), stream=True,
                                                stream_options={"include_usage": True})
            expected = tpm - 15 - reserve
            assert expected <= second <= expected + math.ceil((t1 - t0) * tpm / 60) + 1
            # A stream without usage asked for: the gateway asks the engine for it on its own account.
            third, t2 = await remaining_tokens(c, **ask(prompt, max_tokens=5), stream=True)
            expected -= 15
            assert expected <= third <= expected + math.ceil((t2 - t0) * tpm / 60) + 1
            # A request larger than the whole limit can never pass: 429 saying so, and the SDK does not retry.
            async with client(gw.url, retries=2) as patient:
                with pytest.raises(openai.RateLimitError) as ei:
                    await patient.chat.completions.create(**ask(max_tokens=tpm))
            assert "Request too large" in ei.value.message and ei.value.body["type"] == "tokens"
            assert ei.value.response.headers["x-should-retry"] == "false"
        m = await scrape(gw.url)
        assert m.one("shapegate_ratelimit_refused_total", kind="tokens") == 1  # the SDK sent it once
    finally:
        await gw.stop()


async def test_the_sdk_waits_out_retry_after_and_then_gets_through(engines):
    gw = await start_gateway(config(engines, user={"rpm": 60}))  # one request back per second
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):  # until the bucket is empty, however fast this machine sends
                async with s.post(gw.url + "/v1/chat/completions", json=ask(max_tokens=1),
                                  headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                    await r.read()
                    if r.status == 429:
                        assert r.headers["Retry-After"] == "1"
                        break
            else:
                pytest.fail("60 requests a minute never ran out")
        before = (await scrape(gw.url)).one("shapegate_ratelimit_refused_total", kind="requests")
        seen = len(engines[0].knobs.seen)
        async with client(gw.url, retries=1) as c:
            reply = await c.chat.completions.create(**ask(max_tokens=2))
        assert reply.choices[0].message.content == "w0 w1"
        after = (await scrape(gw.url)).one("shapegate_ratelimit_refused_total", kind="requests")
        assert after == before + 1  # refused once, then served on the SDK's own retry
        assert len(engines[0].knobs.seen) == seen + 1
    finally:
        await gw.stop()


@pytest.fixture
async def redis_prefix():
    if not await redis_up():
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    r = redis_asyncio.Redis.from_url(REDIS_URL)
    yield prefix, r
    keys = [k async for k in r.scan_iter(match=prefix + "*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_replicas_share_buckets_and_settlements_through_redis(engines, redis_prefix):
    prefix, r = redis_prefix
    cfg = config(engines, user={"rpm": 5, "tpm": 1200}, state={"backend": "redis", "key_prefix": prefix})
    one, two = await start_gateway(cfg), await start_gateway(cfg)
    try:
        async with client(one.url) as a, client(two.url) as b:
            prompt = "y" * 808
            reserve = reserved(ask(prompt, max_tokens=5))
            first, t0 = await remaining_tokens(a, **ask(prompt, max_tokens=5))
            assert first == 1200 - reserve
            # One's settlement goes to Redis in a batch, off the request path: wait until it has.
            deadline = time.monotonic() + 10
            while one.state.limiter.shared._pending:
                assert time.monotonic() < deadline, "the settlement never left"
                await asyncio.sleep(0.02)
            second, t1 = await remaining_tokens(b, **ask(prompt, max_tokens=5))
            expected = 1200 - 15 - reserve
            assert expected <= second <= expected + math.ceil((t1 - t0) * 1200 / 60) + 1
            raw = await b.chat.completions.with_raw_response.create(**ask())
            assert raw.headers["x-ratelimit-remaining-requests"] == "2"  # 5 - (one, two, this)
            await a.chat.completions.create(**ask())
            await b.chat.completions.create(**ask())
            with pytest.raises(openai.RateLimitError):
                await a.chat.completions.create(**ask())
        async with client(one.url, ADMIN_KEY) as c:  # no limit: no Redis key is ever made for it
            await c.chat.completions.create(**ask())
        names = {k.decode() async for k in r.scan_iter(match=prefix + "ratelimit:*")}
        assert names == {f"{prefix}ratelimit:requests:4:user", f"{prefix}ratelimit:tokens:4:user"}
        assert 0 < await r.pttl(f"{prefix}ratelimit:requests:4:user") <= 61_000  # gone once full again
        m = await scrape(one.url)
        assert m.value("shapegate_ratelimit_local_decisions_total") == 0
    finally:
        await one.stop()
        await two.stop()


async def test_n_choices_and_an_unreadable_max_tokens_are_reserved_as_the_engine_may_read_them(engines):
    gw = await start_gateway(config(engines, user={"tpm": 6000}))
    try:
        async with aiohttp.ClientSession() as s:
            async def send(body: dict) -> tuple[int, dict, bytes]:
                async with s.post(gw.url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                    return r.status, dict(r.headers), await r.read()

            prompt = reserved(ask(max_tokens=50)) - 50
            status, h, _ = await send(ask(max_tokens=50, n=3))
            assert status == 200 and h["x-ratelimit-remaining-tokens"] == str(6000 - prompt - 150)  # prompt once
            # A string the engine may read as a number (or as no cap): the whole limit, on a full bucket only.
            status, h, data = await send(ask(max_tokens="50"))
            assert status == 429 and "Limit 6000" in orjson.loads(data)["error"]["message"]
            assert "Requested 6000" in orjson.loads(data)["error"]["message"]
    finally:
        await gw.stop()


async def test_a_malformed_bucket_starts_again_empty_for_its_key_alone(redis_prefix):
    prefix, r = redis_prefix
    metrics = Metrics(list)
    shared = SharedBuckets(StateConfig(backend="redis", key_prefix=prefix), metrics)
    bad, good = Need("requests:bad", REQUESTS, 10), Need("requests:good", REQUESTS, 10)
    key = f"{prefix}ratelimit:requests:bad"
    now_ms = int(time.time() * 1000)
    async with shared.running():
        for corrupt in ({"l": "lots", "t": str(now_ms)}, {"l": "5", "t": "soon"}, {"l": "nan", "t": str(now_ms)},
                        {"l": "inf", "t": str(now_ms)}, {"l": "5"}, {"t": str(now_ms)}, "a string", ["a", "list"]):
            await r.delete(key)
            if isinstance(corrupt, dict):
                await r.hset(key, mapping=corrupt)
            elif isinstance(corrupt, str):
                await r.set(key, corrupt)
            else:
                await r.rpush(key, *corrupt)
            # Refused, from an empty bucket; the other key in the same check is not charged; nothing failed.
            assert await shared.take((good, bad), (1, 1), 1.0) == (1, [10.0, 0.0]), corrupt
            assert await r.type(key) == b"hash" and 0 < await r.pttl(key) <= 61_000  # rewritten, expiring
            assert await shared.take((bad,), (1,), 1.0) == (0, [pytest.approx(0.0, abs=0.1)])
        # A stamp ahead of Redis's clock: its level kept, restamped (no refill for time to come).
        await r.hset(key, mapping={"l": "3", "t": str(now_ms + 3_600_000)})
        assert await shared.take((bad,), (1,), 1.0) == (-1, [2.0])
        assert await shared.take((good,), (1,), 1.0) == (-1, [9.0])
        assert shared.up and shared.outages == 0
    assert all(c.value == 0 for c in metrics._limit_local.values())
