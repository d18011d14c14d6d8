"""Shadow experiments through a real gateway: the client's reply untouched, the budget held, outputs compared."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.kit import until

MODEL, CONTROL = "m", "c"


def shadow_config(engines, shadow=True, budget=4, candidate=1) -> dict:
    backends = [{"id": "primary", "engine": "vllm", "url": engines[0].url, "models": [MODEL, CONTROL]},
                {"id": "cand", "engine": "vllm", "url": engines[candidate].url, "models": [MODEL]}]
    cfg = gateway_config(backends)
    if shadow:
        cfg["experiments"] = [{"name": "sh", "model": MODEL, "mode": "shadow", "shadow_max_in_flight": budget,
                               "arms": [{"name": "candidate", "backends": ["cand"]}]}]
    return cfg


async def report(gw) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/experiments", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            return (await r.json())["data"][0]


async def raw_post(gw, body: dict) -> tuple[dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
            return dict(r.headers), await r.read()


def chat(stream: bool, model: str = MODEL, temperature: float | None = 0) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "stream": stream}
    if temperature is not None:
        body["temperature"] = temperature
    return body


async def test_the_client_reply_is_byte_identical_and_the_candidate_never_serves(engines):
    plain = await start_gateway(shadow_config(engines, shadow=False))
    shadowed = await start_gateway(shadow_config(engines))
    try:
        for stream in (False, True):
            h1, b1 = await raw_post(plain, chat(stream))
            h2, b2 = await raw_post(shadowed, chat(stream))
            assert b1 == b2
            assert h2["x-shapegate-backend"] == "primary" and h2["x-shapegate-arm"] == "primary"
        for _ in range(20):
            h, _ = await raw_post(shadowed, chat(False))
            assert h["x-shapegate-backend"] == "primary"
        await until(lambda: engines[1].knobs.active == 0 and len(engines[1].knobs.seen) >= 20, timeout=5)
        # The copies carry the same request, marked, with the client's request id extended.
        copy = engines[1].knobs.headers_seen[-1]
        assert copy["x-shapegate-shadow"] == "sh" and copy["x-request-id"].endswith(".shadow")
    finally:
        await plain.stop()
        await shadowed.stop()


async def test_a_held_copy_never_delays_the_client_stream(engines):
    # The candidate holds every copy until released: if the client's stream waited on its copy in any way
    # (its start, its head, its end), the stream could not finish while the copy is held. No clock is read.
    engines[1].knobs.gate = asyncio.Event()
    gw = await start_gateway(shadow_config(engines, budget=4))
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            for n in range(1, 4):
                async def whole_stream() -> str:
                    stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                             max_tokens=6, temperature=0, stream=True)
                    return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
                assert await asyncio.wait_for(whole_stream(), timeout=10)
                await until(lambda n=n: engines[1].knobs.active == n, timeout=5)  # copy n is held, not lost
        sh = (await report(gw))["arms"][1]["shadow"]
        assert sh["sent"] == 3 and sh["in_flight"] == 3
        engines[1].knobs.gate.set()
        await until(lambda: engines[1].knobs.active == 0, timeout=5)
    finally:
        await gw.stop()


async def test_the_budget_holds_against_a_slow_candidate(engines):
    engines[1].knobs.gate = asyncio.Event()  # the candidate holds every copy until released
    gw = await start_gateway(shadow_config(engines, budget=2))
    try:
        for _ in range(8):
            h, _ = await raw_post(gw, chat(False))
            assert h["x-shapegate-backend"] == "primary"  # answered at once: the copies never delay the client
        await until(lambda: engines[1].knobs.active == 2, timeout=5)
        x = await report(gw)
        sh = x["arms"][1]["shadow"]
        assert sh["sent"] == 2 and sh["skipped_busy"] == 6 and sh["in_flight"] == 2
        engines[1].knobs.gate.set()
        await until(lambda: engines[1].knobs.active == 0, timeout=5)
        assert engines[1].knobs.max_active == 2
    finally:
        await gw.stop()


async def test_a_dead_candidate_is_skipped_and_counted(engines):
    gw = await start_gateway(shadow_config(engines))
    try:
        await engines[1].stop()
        await until(lambda: gw.state.pool.get("cand").health.state != "ready", timeout=5)
        for _ in range(3):
            h, _ = await raw_post(gw, chat(False))
            assert h["x-shapegate-backend"] == "primary"
        x = await report(gw)
        assert x["arms"][1]["shadow"]["skipped_unhealthy"] == 3
    finally:
        await gw.stop()


@pytest.mark.parametrize("same", [True, False])
async def test_agreement_of_outputs_at_temperature_zero(engines, same):
    if not same:
        engines[2].knobs.word = "z"  # another engine that says something else
    gw = await start_gateway(shadow_config(engines, candidate=1 if same else 2))
    try:
        for stream in (False, True, False, True):
            await raw_post(gw, chat(stream))
        await raw_post(gw, chat(False, temperature=0.7))  # not greedy: not compared
        x = gw.state.experiments.by_name["sh"]
        # Each copy's comparison is made as its primary's figures are recorded: after five, all are in.
        await until(lambda: (c := x.classes.get(("primary", "all"))) is not None and c.requests == 5, timeout=5)
        ag = (await report(gw))["arms"][1]["shadow"]["agreement"]
        assert ag["compared"] == 4
        if same:
            assert ag["exact"] == 4 and ag["common_prefix_share"]["mean"] == 1.0
            assert ag["common_prefix_tokens"]["n"] == 2 and ag["common_prefix_tokens"]["mean"] == 6
        else:
            assert ag["exact"] == 0 and ag["common_prefix_share"]["mean"] == 0.0
            assert ag["common_prefix_tokens"]["mean"] == 0
    finally:
        await gw.stop()
