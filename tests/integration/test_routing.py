"""Shape routing through a real gateway in front of simulated engines: reasons, sessions, affinity, replicas."""

from __future__ import annotations

import asyncio
import secrets

import aiohttp
import pytest
import redis.asyncio as redis_asyncio

from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.needs import skip_or_fail

MODEL = "m"


@pytest.fixture
async def sims():
    servers = [await start_sim(SimOptions(engine=e, model=MODEL)) for e in ("vllm", "sglang", "llamacpp")]
    yield servers
    for s in servers:
        await s.close()


def backends(sims) -> list[dict]:
    v, s, l = sims
    models = {MODEL: MODEL, "other": MODEL}  # a second public name for the same engine model
    return [{"id": "vllm", "engine": "vllm", "url": v.url, "models": models},
            {"id": "sglang", "engine": "sglang", "url": s.url, "models": models},
            {"id": "llama", "engine": "llamacpp", "url": l.url, "models": models, "interactive": True}]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                     headers={"Authorization": f"Bearer {USER_KEY}"}) as s:
        yield s


async def chat(http, gw, text: str, max_tokens: int = 8, stream: bool = True, model: str = MODEL,
               headers: dict | None = None) -> tuple[str, str]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-shapegate-backend"], r.headers["x-shapegate-reason"]


async def wait_loads(gw, timeout: float = 5.0) -> None:
    """Until every backend has a fresh load sample (slot counts for llama.cpp)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while any(b.load is None for b in gw.state.pool.all()):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_shape_explains_each_class_and_sends_a_session_to_the_interactive_slot(sims, http):
    gw = await start_gateway(gateway_config(backends(sims), routing={"policy": "shape"}))
    try:
        await wait_loads(gw)
        backend, reason = await chat(http, gw, "write", max_tokens=600)
        assert reason.startswith("shape:long_output e2e=")
        backend, reason = await chat(http, gw, "doc " * 1000, max_tokens=20)
        assert reason.startswith("shape:long_prompt ")  # "ttft=..." or, while engines are unmeasured, "explore"
        backend, reason = await chat(http, gw, "hi", headers={"x-session-id": "s1"})
        assert (backend, reason.split(" ")[0:3]) == ("llama", ["shape:interactive", "slot", "llama"])
        assert len(reason) < 80
    finally:
        await gw.stop()


async def test_the_latency_model_learns_from_the_gateways_own_streams(sims, http):
    gw = await start_gateway(gateway_config(backends(sims), routing={"policy": "shape"},
                                            stats={"warmup_samples": 1}))
    try:
        for i in range(12):
            await chat(http, gw, f"question {i}", max_tokens=16)
        models = {b.id: b.latency for b in gw.state.pool.all()}
        assert sum(m.samples for m in models.values()) >= 12 - 3  # one warm-up sample per backend skipped
        assert all(m.samples + m.skipped >= 1 for m in models.values())  # every engine was tried
        async with http.get(gw.url + "/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            rows = (await r.json())["backends"]
        assert all(row["model"]["itl_a_ms"] > 0 for row in rows)
    finally:
        await gw.stop()


async def test_prefix_affinity_sticks_and_per_model_policy_overrides(sims, http):
    cfg = gateway_config(backends(sims), routing={"policy": "prefix_affinity",
                                                  "models": {"other": {"policy": "round_robin"}}})
    gw = await start_gateway(cfg)
    try:
        system = "You are a careful agent. " * 80
        first, reason = await chat(http, gw, system + "task 1", stream=False)
        assert reason.startswith("prefix_affinity:least_loaded")
        for i in range(3):
            backend, reason = await chat(http, gw, system + f"task {i + 2}", stream=False)
            assert (backend, reason.split(" ")[0]) == (first, "prefix_affinity:prefix")
        _, reason = await chat(http, gw, system, model="other")
        assert reason == "round_robin"
    finally:
        await gw.stop()


async def test_replicas_share_affinity_through_redis(sims, http):
    client = redis_asyncio.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=0.5)
    try:
        await client.ping()
    except (OSError, redis_asyncio.RedisError):
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    state = {"backend": "redis", "key_prefix": prefix, "flush_interval_s": 0.05}
    cfg = gateway_config(backends(sims), routing={"policy": "prefix_affinity"}, state=state)
    a, b = await start_gateway(cfg), await start_gateway(cfg)
    try:
        system = "Shared agent instructions. " * 80
        served, _ = await chat(http, a, system + "from replica a", stream=False)
        deadline = asyncio.get_running_loop().time() + 5
        while not len(b.state.affinity_index):  # a flushes its new prefix to Redis, b pulls it
            assert asyncio.get_running_loop().time() < deadline, "replica b never saw replica a's prefix"
            await asyncio.sleep(0.01)
        for i in range(3):
            backend, reason = await chat(http, b, system + f"from replica b {i}", stream=False)
            assert (backend, reason.split(" ")[0]) == (served, "prefix_affinity:prefix")
    finally:
        await a.stop()
        await b.stop()
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
