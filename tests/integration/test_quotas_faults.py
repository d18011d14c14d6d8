"""A token quota per day across two gateway processes on one Redis, while Redis flaps, restarts empty or is full:
the key is served at most its quota (and what the processes' views differ by: about a request), and not shut out."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as redis_asyncio

from benchmarks.loopback import Proc
from gateway.keys.principal import hash_key
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.integration.test_limits_replicas import RedisServer, replicas_seen, until
from tests.procs import gateway_proc, to_toml

# The fake engine's usage: 10 prompt tokens and max_tokens (1) completion tokens. The prompt below is estimated
# at more than that, so each request reserves more than it uses and is settled down to 11.
USED = 11
BODY = {"model": "m1", "messages": [{"role": "user", "content": "a question of some length " * 5}], "max_tokens": 1}
QUOTA = 30 * USED
SENDS = 80  # 5 a second for 16 s, alternating replicas
OTHER_KEY = "sk-test-other-key"


async def start_pair(tmp_path: Path, engine: FakeEngine, redis_url: str) -> list[Proc]:
    keys = [{"id": "user", "sha256": hash_key(USER_KEY), "limits": {"tokens_per_day": QUOTA}},
            {"id": "other", "sha256": hash_key(OTHER_KEY), "limits": {"tokens_per_day": QUOTA}},
            {"id": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True, "limits": {}}]
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}], auth={"keys": keys},
                         limits={"redis_timeout_s": 0.05, "processes": 2},
                         state={"backend": "redis", "redis_url": redis_url, "key_prefix": "quotas:",
                                "flush_interval_s": 0.05})
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(cfg))
    procs = [gateway_proc(path, log=tmp_path / f"gw{i}.log") for i in range(2)]
    await asyncio.gather(*(p.start(timeout=20.0) for p in procs))
    for p in procs:
        await until(lambda p=p: replicas_seen(p), "two replicas seen")
    return procs


async def drive(procs: list[Proc], seconds: float) -> tuple[int, dict[str, str]]:
    """SENDS requests at even steps over `seconds`, replicas alternating: how many were served, and the headers of
    the last refusal."""
    step = seconds / SENDS
    refused: dict[str, str] = {}

    async def post(s: aiohttp.ClientSession, url: str) -> int:
        async with s.post(url + "/v1/chat/completions", json=BODY,
                          headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
            body = await r.json()
            assert r.status in (200, 429), (r.status, body)
            if r.status == 429:
                assert body["error"]["code"] == "quota_exceeded", body
                refused.update(r.headers)
            else:
                assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == USED
            return r.status

    async with aiohttp.ClientSession() as s:
        start = time.monotonic()
        tasks = []
        for i in range(SENDS):
            await asyncio.sleep(max(0.0, start + i * step - time.monotonic()))
            tasks.append(asyncio.create_task(post(s, procs[i % 2].url)))
        statuses = await asyncio.gather(*tasks)
    return sum(st == 200 for st in statuses), refused


@pytest.fixture
async def engine():
    e = await FakeEngine(Knobs()).start()
    yield e
    await e.stop()


@pytest.fixture
async def redis(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    await server.stop()


async def flapping(redis: RedisServer) -> None:  # frozen a second (every check times out), answering a second
    while True:
        redis.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
        finally:
            redis.signal(signal.SIGCONT)
        await asyncio.sleep(1.0)


async def restarting(redis: RedisServer) -> None:  # killed and started again, empty, every 2 s
    while True:
        await asyncio.sleep(2.0)
        await redis.stop()
        await redis.start()


async def full(redis: RedisServer) -> None:  # every write refused (maxmemory, noeviction), from the start
    r = redis_asyncio.Redis.from_url(redis.url)
    try:
        async with r.pipeline(transaction=False) as p:
            for i in range(300):
                p.set(f"junk:{i}", b"x" * 10_000)
            await p.execute()
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", "1mb")
        await asyncio.Event().wait()
    finally:
        await r.aclose()


@pytest.mark.parametrize("fault", [None, flapping, restarting, full])
async def test_a_day_quota_holds_across_two_replicas_under_redis_faults(tmp_path, engine, redis, fault):
    await redis.start()
    procs = await start_pair(tmp_path, engine, redis.url)
    try:
        faults = asyncio.create_task(fault(redis)) if fault is not None else None
        try:
            served, refused = await drive(procs, 16.0)
        finally:
            if faults is not None:
                faults.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await faults
        name = fault.__name__ if fault is not None else "no fault"
        print(f"{name}: {served} of {SENDS} served, {served * USED} tokens of a quota of {QUOTA}")
        assert served * USED <= QUOTA + USED  # the quota, and at most a request more (the processes' views)
        assert served * USED >= QUOTA // 2  # not shut out: at least each process's share
        assert refused["x-ratelimit-limit-tokens-day"] == str(QUOTA)
        assert 1 <= int(refused["Retry-After"]) <= 120 and refused["x-ratelimit-reset-tokens-day"].endswith("s")
    finally:
        for p in procs:
            await p.stop()
        for p in procs:
            assert "Traceback" not in p.stderr_text()


async def sequential(procs: list[Proc], key: str, n: int) -> tuple[int, set[str]]:
    """`n` requests one after another, a fifth of a second apart, replicas alternating: how many were served, and
    the refusals' codes."""
    served, codes = 0, set()
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            async with s.post(procs[i % 2].url + "/v1/chat/completions", json=BODY,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                body = await r.json()
                served += r.status == 200
                if r.status != 200:
                    codes.add(body["error"]["code"])
            await asyncio.sleep(0.2)  # each request's settlement (its estimate down to its usage) sent meanwhile
    return served, codes


async def test_a_flushed_quota_keeps_its_count_and_a_malformed_one_is_used_up(tmp_path, engine, redis):
    await redis.start()
    procs = await start_pair(tmp_path, engine, redis.url)
    r = redis_asyncio.Redis.from_url(redis.url)
    try:
        first, codes = await sequential(procs, USER_KEY, 10)
        assert first == 10, codes
        await asyncio.sleep(0.5)  # the settlements sent
        await r.flushdb()  # the quota's key is gone, the server the same: each replica's view carries it on
        more, codes = await sequential(procs, USER_KEY, 40)
        print(f"flushed: {first} served before, {more} after, of a quota of {QUOTA // USED} requests")
        assert (first + more) * USED <= QUOTA + USED and codes == {"quota_exceeded"}
        # Not a number: the quota is used up for the rest of the day, that key's alone.
        day = (await r.keys("quotas:ratelimit:quota:tokens-day:5:other:*")) or [None]
        other_key = f"quotas:ratelimit:quota:tokens-day:5:other:{time.strftime('%Y-%m-%d', time.gmtime())}"
        assert day == [None]
        await r.set(other_key, "plenty")
        served, codes = await sequential(procs, OTHER_KEY, 6)
        assert served == 0 and codes == {"quota_exceeded"}
        assert float(await r.get(other_key)) >= QUOTA and await r.pttl(other_key) > 0
    finally:
        for p in procs:
            await p.stop()
        await r.aclose()
