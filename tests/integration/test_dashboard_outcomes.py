"""The dashboard in a real browser shows outcomes, engine error rate, p99s, failovers, breaker openings, reasons."""

from __future__ import annotations

import aiohttp
import openai
import orjson

from benchmarks.loopback import free_port
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.integration.browser import LIVE_JS, FormLogin, open_page

TOO_LONG = b'{"error":{"message":"prompt too long","type":"BadRequestError","param":null,"code":400}}'


async def test_browser_shows_outcomes_as_the_feed_has_them(chromium):
    good = await FakeEngine(Knobs(chunk_delay=0.002)).start()
    busy = await FakeEngine(Knobs(fail_status=503, retry_after="60")).start()
    gw = await start_gateway(gateway_config([
        {"id": "good", "engine": "vllm", "url": good.url, "models": ["m1"]},
        {"id": "busy", "engine": "llamacpp", "url": busy.url, "models": ["m1"]},
        {"id": "down", "engine": "vllm", "url": f"http://127.0.0.1:{free_port()}", "models": ["m2"]},
    ], routing={"policy": "round_robin"}))
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
            msgs = [{"role": "user", "content": "hi"}]
            for _ in range(4):  # the first one that meets `busy` fails over and opens its breaker
                stream = await client.chat.completions.create(model="m1", messages=msgs, max_tokens=6, stream=True)
                [c async for c in stream]
            good.knobs.fail_status, good.knobs.fail_body = 400, TOO_LONG
            for _ in range(2):
                try:
                    await client.chat.completions.create(model="m1", messages=msgs, max_tokens=6)
                except openai.BadRequestError:
                    pass
            try:
                await client.chat.completions.create(model="m2", messages=msgs, max_tokens=6)
            except openai.APIStatusError as e:
                assert e.status_code == 503
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/dashboard/feed",
                                                       headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            feed = orjson.loads(await r.read())
        async with open_page(width=1440, height=1000) as page:
            await page.authenticate(gw.url + "/dashboard", FormLogin(ADMIN_KEY))
            await page.wait_for(LIVE_JS, timeout=15.0)
            shown = await page.read()
            errors = list(page.errors)
    finally:
        await gw.stop()
        await good.stop()
        await busy.stop()
    assert errors == []
    rows = {b["id"]: b for b in feed["backends"]}
    assert rows["good"]["overall"]["outcomes"] == {"ok": 4, "client_left": 0, "client_error": 2, "engine_error": 0}

    def value(testid: str) -> float:
        return float(shown[testid]["value"])

    for bid, row in rows.items():
        for k, n in row["overall"]["outcomes"].items():
            assert value(f"outcome:{k}:{bid}") == n, (bid, k)
        assert value(f"failovers:{bid}") == row["failovers"]
        assert value(f"breaker_openings:{bid}") == row["breaker_openings"]
        assert value(f"table:error_rate:{bid}") == row["overall"]["error_rate"]
    assert value("table:error_rate:good") == 0  # the client's 400s are not the engine's errors
    assert value("table:error_rate:busy") == 1.0 and value("breaker_openings:busy") == 1
    assert shown["breaker:busy"]["text"] == "open"
    for m in ("itl", "e2e"):
        assert value(f"table:{m}_p99:good") == rows["good"]["overall"][f"{m}_ms"]["p99"] > 0
    assert value("totals:rejected") == feed["totals"]["rejected"] == 1
    assert value("totals:queued") == feed["queue"]["length"] == 0 and shown["totals:queued"]["text"] == "0"
    assert value("totals:error_rate") == feed["totals"]["error_rate"]
    assert value("totals:workers") == 1 and shown["totals:workers"]["text"] == "1"
    assert value("reason:default:round_robin") == feed["classes"]["default"]["reasons"]["round_robin"] == 6
    assert value("route:default:rejected") == 1
    assert shown["replicas"]["hidden"] is True  # no Redis store: no replicas panel
