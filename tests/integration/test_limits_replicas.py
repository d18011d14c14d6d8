"""Rate limits across two gateway processes sharing Redis, and each on its own share while Redis is slow or down."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import time
from functools import partial
from pathlib import Path

import aiohttp
import openai
import pytest
import redis.asyncio as redis_asyncio

from benchmarks.loopback import Proc, restartable_port
from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.integration.test_metrics import scrape
from tests.needs import REDIS_URL, redis_up, skip_or_fail
from tests.procs import gateway_proc, to_toml

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def call(c: openai.AsyncOpenAI) -> tuple[int, dict[str, str]]:
    """One request: its status and headers, served or refused."""
    try:
        raw = await c.chat.completions.with_raw_response.create(**BODY)
    except openai.RateLimitError as e:
        return 429, dict(e.response.headers)
    return raw.status_code, dict(raw.headers)


def client(gw: Proc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0)


async def start_pair(tmp_path: Path, engine: FakeEngine, state: dict) -> list[Proc]:
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}],
                         limits={"rpm": 60, "redis_timeout_s": 0.05, "restart_hold_s": 3.0},
                         state={"backend": "redis", **state})
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(cfg))
    procs = [gateway_proc(path, log=tmp_path / f"gw{i}.log") for i in range(2)]
    await asyncio.gather(*(p.start() for p in procs))
    return procs


# Replicas and a Redis of their own, all processes: the waits allow 20 s and poll every 50 ms.
until = partial(kit.until, timeout=20.0, every=0.05)


async def replicas_seen(gw: Proc) -> bool:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/stats?scope=replicas", headers=ADMIN) as r:
        return r.status == 200 and len((await r.json())["replicas"]) == 2


@pytest.fixture
async def engine():
    e = await FakeEngine(Knobs()).start()
    yield e
    await e.stop()


async def test_sixty_a_minute_hold_across_two_replicas(tmp_path, engine):
    if not await redis_up():
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    procs = await start_pair(tmp_path, engine, {"key_prefix": prefix})
    r = redis_asyncio.Redis.from_url(REDIS_URL)
    try:
        a, b = client(procs[0]), client(procs[1])
        started = time.monotonic()
        # 60 at once, alternating replicas: the bucket starts full, so every one of them passes ...
        burst = await asyncio.gather(*(call(a if i % 2 == 0 else b) for i in range(60)))
        # ... and the 61st is refused on either replica.
        extra = [await call(a), await call(b)]
        elapsed = time.monotonic() - started
        assert [status for status, _ in burst] == [200] * 60
        assert {h["x-ratelimit-limit-requests"] for _, h in burst} == {"60"}
        if elapsed < 1.0:  # one request a second comes back: only a run this long could see one
            # Each decision saw the one shared bucket: every remaining count exactly once, whichever replica.
            assert sorted(int(h["x-ratelimit-remaining-requests"]) for _, h in burst) == list(range(60))
            assert [status for status, _ in extra] == [429, 429]
        else:
            assert sum(status == 200 for status, _ in extra) <= int(elapsed)
        assert [h["retry-after"] for status, h in extra if status == 429] in (["1"], ["1", "1"], [])
        for p in procs:
            m = await scrape(p.url)
            assert m.value("shapegate_ratelimit_local_decisions_total") == 0
        await a.close()
        await b.close()
    finally:
        for p in procs:
            await p.stop()
        keys = [k async for k in r.scan_iter(match=prefix + "*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()


class RedisServer:
    """A redis-server of this test's own on a port of its own: stopped, frozen and restarted at will."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = restartable_port()
        self.dir = tmp_path
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            skip_or_fail("redis-server is not installed (apt-get install -y redis-server)")
        self.proc = await asyncio.create_subprocess_exec(
            exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.dir), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        client = redis_asyncio.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            async def answers() -> bool:
                try:
                    return bool(await client.ping())
                except (OSError, redis_asyncio.RedisError):
                    return False
            await until(answers, f"redis-server on port {self.port}", timeout=10.0)
        finally:
            await client.aclose()

    def signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.returncode is None
        self.proc.send_signal(sig)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen server must be able to end
            self.proc.terminate()
            await self.proc.wait()


async def local_count(gw: Proc, reason: str) -> float:
    return (await scrape(gw.url)).one("shapegate_ratelimit_local_decisions_total", reason=reason)


async def test_each_replica_holds_its_share_while_redis_is_slow_or_down_then_shares_again(tmp_path, engine):
    redis = RedisServer(tmp_path)
    await redis.start()
    procs: list[Proc] = []
    try:
        procs = await start_pair(tmp_path, engine, {"redis_url": redis.url, "key_prefix": "limits:"})
        one, two = procs
        for p in procs:  # each replica knows of the other through the stats it publishes in Redis
            await until(lambda p=p: replicas_seen(p), "two replicas seen")
        a, b = client(one), client(two)
        assert (await call(a))[1]["x-ratelimit-limit-requests"] == "60"

        redis.signal(signal.SIGSTOP)  # slow: no answer within [limits] redis_timeout_s
        status, h = await call(a)
        assert status == 200 and h["x-ratelimit-limit-requests"] == "30"  # its share: 60 over 2 replicas
        assert await local_count(one, "timeout") == 1
        started, served = time.monotonic(), 1
        while (await call(a))[0] == 200:
            served += 1
            assert served <= 60, "the local share was never enforced"
        # Its share of what Redis last said was left (59, after the request above): 29.5, so 29 at once; the share
        # refills at half a request a second, so only a slow run sees more.
        assert 29 <= served <= 29 + int((time.monotonic() - started) / 2 + 0.5)
        assert await local_count(one, "unavailable") >= served - 1  # decided alone without asking Redis again
        redis.signal(signal.SIGCONT)

        async def shared_again(c: openai.AsyncOpenAI) -> bool:
            return (await call(c))[1]["x-ratelimit-limit-requests"] == "60"

        await until(lambda: shared_again(a), "back on the shared buckets after Redis answered")

        await redis.stop()  # down: connections refused
        status, h = await call(b)
        assert status == 200 and h["x-ratelimit-limit-requests"] == "30"
        assert await local_count(two, "error") == 1
        await redis.start()  # back, empty: a new run id, so its buckets are not trusted for [limits] restart_hold_s
        status, h = await call(b)
        assert status == 200 and h["x-ratelimit-limit-requests"] == "30"

        async def held_off(c: openai.AsyncOpenAI) -> bool:  # decided alone once the probe saw the new run id
            return (await call(c))[1]["x-ratelimit-limit-requests"] == "30" and await local_count(two, "restarted")

        await until(lambda: held_off(b), "decided alone after Redis restarted")
        await until(lambda: shared_again(b), "back on the shared buckets once the hold is over")
        await a.close()
        await b.close()
    finally:
        for p in procs:
            await p.stop()
        await redis.stop()
    for p in procs:
        assert "Traceback" not in p.stderr_text()
