"""Replicas sharing a Redis store: each replica's figures, labelled, and all of them merged."""

from __future__ import annotations

import secrets
from functools import partial

import aiohttp
import orjson
import redis.asyncio as redis_asyncio

from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=ADMIN) as r:
        return r.status, orjson.loads(await r.read())


async def chat(url: str, n: int) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                assert r.status == 200


# Gateways sharing Redis: the waits allow 10 s and poll every tenth of a second.
until = partial(kit.until, timeout=10.0, every=0.1)


async def test_replicas_are_shown_labelled_and_merged():
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    engine = await FakeEngine(Knobs()).start()
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}],
                         state={"backend": "redis", "key_prefix": prefix})
    one, two = await start_gateway(cfg), await start_gateway(cfg)
    running = [one, two]
    client = redis_asyncio.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        await chat(one.url, 5)
        await chat(two.url, 3)

        async def both() -> dict | None:
            _, rep = await get(one.url + "/stats?scope=replicas")
            done = len(rep["replicas"]) == 2 and rep["fleet"]["totals"]["requests"] == 8
            return rep if done else None

        rep = await until(both)
        assert rep["shared"] is True
        mine, other = sorted(rep["replicas"], key=lambda r: not r["self"])
        assert mine["self"] and not other["self"] and mine["replica"] != other["replica"]
        assert (mine["totals"]["requests"], other["totals"]["requests"]) == (5, 3)
        assert mine["backends"][0]["overall"]["outcomes"]["ok"] == 5
        assert rep["fleet"]["workers"]["count"] == 2
        assert rep["fleet"]["backends"][0]["views"]["health"] == {"ready": 2}
        # The group feed stays this replica's own, with a labelled line per replica beside it.
        _, group = await get(one.url + "/stats")
        assert group["totals"]["requests"] == 5
        assert {(r["self"], r["requests"], r["workers"]) for r in group["replicas"]} == {(True, 5, 1), (False, 3, 1)}
        # Each replica pulls the others' summaries on its own period: two may see one a moment later.

        async def seen_by_two() -> bool:
            _, feed = await get(two.url + "/dashboard/feed")
            return {(r["self"], r["requests"]) for r in feed["replicas"]} == {(True, 3), (False, 5)}

        await until(seen_by_two)
        assert (await get(one.url + "/stats?scope=everything"))[0] == 400

        await running.pop().stop()  # a replica that stops withdraws its entry at once

        async def alone() -> bool:
            _, rep = await get(one.url + "/stats?scope=replicas")
            return len(rep["replicas"]) == 1 and rep["fleet"]["totals"]["requests"] == 5

        await until(alone)
    finally:
        for gw in running:
            await gw.stop()
        await engine.stop()
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
