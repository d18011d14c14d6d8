"""A seat count one replica learned from an engine's load holds a replica that starts later from its first request:
it queues what the engine has no seat for instead of sending it there."""

from __future__ import annotations

import asyncio

import openai
import orjson

from gateway.sim.options import SimOptions
from gateway.sim.runner import start_sim
from tests.gateway_harness import USER_KEY
from tests.integration.replicas_kit import (MODEL, Replicas, drop_keys, get_json, metric, new_prefix, redis_client,
                                            until)

SEATS = 2
# Each stream lasts ~3 s on this profile (~20 ms a token at 2 running): long enough to be counted while it runs.
TOKENS = 150


def stream(c: openai.AsyncOpenAI, i: int) -> asyncio.Task:
    async def run() -> None:
        chunks = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
                                                 max_tokens=TOKENS, stream=True, extra_body={"ignore_eos": True})
        async for _ in chunks:
            pass
    return asyncio.create_task(run())


async def held(p) -> float:
    """Requests waiting in `p`'s queue, whatever their priority."""
    return sum([await metric(p, "shapegate_queue_length", priority=level) for level in ("high", "normal", "low")])


async def test_a_replica_that_starts_later_holds_what_the_engine_has_no_seat_for(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    engine = await start_sim(SimOptions(engine="vllm", profile="r9700-vllm", slots=SEATS))
    sched = engine.state.sched
    # No seat share (every request counts alike); load read every 0.1 s, so `a` learns within a second.
    replicas = Replicas(tmp_path, [{"id": "v", "engine": "vllm", "url": engine.url, "models": {MODEL: "sim-model"}}],
                        prefix, queue={"seat_shares": {}}, health={"load_interval_s": 0.1})
    tasks: list[asyncio.Task] = []
    try:
        a = await replicas.start()
        async with openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            # Nothing known of the engine: `a` sends all four, the engine runs two and queues two, and `a` learns.
            tasks = [stream(c, i) for i in range(4)]

            async def written() -> dict | None:
                raw = await client.hget(prefix + "seats", "v")
                return orjson.loads(raw) if raw and orjson.loads(raw)["full"] == SEATS else None

            assert await until(written, "a wrote the seat count it learned") == \
                {"url": engine.url, "full": SEATS, "peak": SEATS}
            await asyncio.gather(*tasks)
        await until(lambda: not sched.running and not sched.waiting, "the engine idle")

        b = await replicas.start()
        async with openai.AsyncOpenAI(base_url=b.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            tasks = [stream(c, i) for i in range(5)]
            # `b` sends the engine its seats and one more (a learned count is probed one past), and holds two.
            await until(lambda: len(sched.running) + len(sched.waiting) == SEATS + 1, "the engine's seats taken")
            await until(lambda: held(b), "requests held in b")
            await asyncio.sleep(0.3)  # several load reads later: still no more at the engine
            assert len(sched.running) + len(sched.waiting) == SEATS + 1
            assert await held(b) == 2
            assert await metric(b, "shapegate_replica_imports_total", kind="seats") == 1
            (row,) = (await get_json(b.url + "/stats"))["backends"]
            assert row["seats"] == SEATS
            await asyncio.gather(*tasks)  # and every one is served
    finally:
        for t in tasks:
            t.cancel()
        await replicas.stop()
        await engine.close()
        await drop_keys(client, prefix)
        await client.aclose()
