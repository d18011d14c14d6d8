"""Redis killed and restarted under load: two replicas serve every request meanwhile and agree again afterwards."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import openai
import redis.asyncio as redis_asyncio

from benchmarks.loopback import Proc, restartable_port
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import USER_KEY
from tests.integration.replicas_kit import MODEL, Replicas, backend, get_json, metric, new_prefix, session_turn, until
from tests.needs import skip_or_fail


def redis_server(port: int, workdir: Path) -> Proc:
    """A redis-server of the test's own (never the shared one on 6379), keeping nothing on disk."""
    binary = shutil.which("redis-server")
    if binary is None:
        skip_or_fail("redis-server is not installed (apt-get install -y redis-server)")
    return Proc([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(workdir)], port, "")


class Load:
    """A steady stream of requests through every replica, one at a time each, until stopped."""

    def __init__(self, replicas: list[Proc]) -> None:
        self.served = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run(p, i)) for i, p in enumerate(replicas)]

    async def _run(self, p: Proc, n: int) -> None:
        async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=10) as c:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    await c.chat.completions.create(model=MODEL, max_tokens=3,
                                                    messages=[{"role": "user", "content": f"load {n}.{i}"}])
                    self.served += 1
                except openai.OpenAIError as e:
                    self.failures.append(f"{p.url}: {e!r}")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)  # (again: a no-op)


async def test_requests_flow_while_redis_is_down_and_state_converges_once_it_is_back(tmp_path):
    port = restartable_port()
    url = f"redis://127.0.0.1:{port}/0"
    store = await redis_server(port, tmp_path).start(wait=False)
    client = await until(lambda: _answering(url), "our redis-server answers")
    prefix = new_prefix()
    engines = [await FakeEngine(Knobs()).start() for _ in range(2)]
    replicas = Replicas(tmp_path, [backend(f"e{i}", e) for i, e in enumerate(engines)], prefix, redis_url=url,
                        routing={"policy": "prefix_affinity"})
    load = None
    try:
        a, b = await replicas.start(), await replicas.start()
        await until(lambda: _see_each_other(a, b), "both replicas in each one's /stats?scope=replicas")
        load = Load([a, b])
        await until(lambda: _served(load, 20), "requests flow")

        await store.kill()
        at_kill = load.served

        async def down_a_while() -> bool:  # two seconds of failed rounds: ten of breakers, a latency and a seat one
            return all([await metric(p, "shapegate_replica_sync_errors_total") >= 12 for p in (a, b)])

        await until(down_a_while, "both replicas found Redis gone for a while")
        await until(lambda: _served(load, at_kill + 100), "requests flow without Redis")

        store = await redis_server(port, tmp_path).start(wait=False)
        await client.aclose()
        client = await until(lambda: _answering(url), "our redis-server answers again")
        await until(lambda: _see_each_other(a, b), "both replicas in each one's /stats?scope=replicas again")
        # Affinity made on one replica after the return is seen on the other.
        first, _ = await session_turn(client, prefix, a, b, "s-after", "turn 0")
        assert await session_turn(client, prefix, b, a, "s-after", "turn 1") == (
            first, f"prefix_affinity:session -> {first}")
        # Latency learning is published again: one entry per replica.
        await until(lambda: _hlen(client, prefix + "latency", 2), "both replicas' latency entries back in Redis")
        await load.stop()
        assert load.failures == [] and load.served > at_kill + 100, load.failures[:5]
        logs = [p.stderr_text() for p in (a, b)]
        assert all(log.count("seat counts not shared (Redis") == 1 for log in logs), replicas.logs()
        assert all(log.count("Redis answers again") == 1 for log in logs), replicas.logs()
    finally:
        if load is not None:
            await load.stop()
        await replicas.stop()
        for e in engines:
            await e.stop()
        await store.kill()
        await client.aclose()


async def _answering(url: str) -> redis_asyncio.Redis | None:
    client = redis_asyncio.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        await client.ping()
    except (OSError, redis_asyncio.RedisError):
        await client.aclose()
        return None
    return client


async def _see_each_other(a: Proc, b: Proc) -> bool:
    for p in (a, b):
        rep = await get_json(p.url + "/stats?scope=replicas")
        if len(rep["replicas"]) != 2:
            return False
    return True


async def _served(load: Load, n: int) -> bool:
    assert not load.failures, load.failures[:5]
    return load.served >= n


async def _hlen(client: redis_asyncio.Redis, key: str, n: int) -> bool:
    return await client.hlen(key) >= n
