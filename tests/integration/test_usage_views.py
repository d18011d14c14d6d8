"""The usage ledger in one process's memory: refusals per key, GET /admin/usage with the dashboard's cookie, the
dashboard's view over days, and the ledger switched off."""

from __future__ import annotations

import aiohttp

from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = {"Authorization": f"Bearer {USER_KEY}"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_refusals_and_the_dashboards_view_over_days():
    engine = await FakeEngine(Knobs(stream_chunks=3)).start()
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engine.url, "models": ["m"]}],
                         limits={"rpm": 2}, usage={"flush_interval_s": 0.05,
                                                   "prices": {"m": {"input_per_million": 1000.0,
                                                                    "output_per_million": 2000.0}}})
    gw = await start_gateway(cfg)
    try:
        # (unsafe: keep the sign-in cookie of a gateway at an IP address)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
            statuses = []
            for _ in range(3):
                async with s.post(gw.url + "/v1/chat/completions", json=BODY, headers=USER) as r:
                    statuses.append(r.status)
            assert statuses == [200, 200, 429]

            async def counted() -> dict | None:
                async with s.get(gw.url + "/admin/usage", headers=ADMIN, params={"by": "key,backend"}) as r:
                    assert r.status == 200
                    report = await r.json()
                return report if report["totals"]["refused"] == 1 and report["totals"]["requests"] == 2 else None

            report = await kit.until(counted, "two requests and a refusal counted")
            assert report["store"] == "memory" and report["scope"] == "process"
            rows = {r["backend"]: r for r in report["rows"]}
            assert rows["e"]["requests"] == 2 and rows[""]["refused"] == 1  # a refusal has no backend
            user = report["keys"]["user"]
            assert user["cost"] == (user["prompt_tokens"] * 1000.0 + user["completion_tokens"] * 2000.0) / 1e6
            # The dashboard's cookie opens /admin/usage and the view; the view reads days, by day and by key.
            async with s.post(gw.url + "/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False) as r:
                assert r.status == 303
            async with s.get(gw.url + "/admin/usage") as r:
                assert r.status == 200
            async with s.get(gw.url + "/dashboard/usage", params={"days": "30"}) as r:
                assert r.status == 200
                view = await r.json()
            assert view["days"] == 30 and view["priced"] and view["by_key"][0]["key"] == "user"
            assert len(view["by_day"]) == 1 and view["by_day"][0]["requests"] == 2
            assert view["totals"]["refused"] == 1
            async with s.get(gw.url + "/dashboard/usage", params={"days": "2"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "days"
            async with s.get(gw.url + "/dashboard/static/usage.js") as r:
                assert r.status == 200
        async with aiohttp.ClientSession() as anonymous:
            async with anonymous.get(gw.url + "/dashboard/usage") as r:
                assert r.status == 401
            async with anonymous.get(gw.url + "/admin/usage", headers=USER) as r:
                assert r.status in (401, 403)
    finally:
        await gw.stop()
        await engine.stop()


async def test_the_ledger_switched_off():
    engine = await FakeEngine().start()
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engine.url, "models": ["m"]}],
                         usage={"enabled": False})
    gw = await start_gateway(cfg)
    try:
        assert gw.state.ledger is None and gw.state.usage is None
        async with aiohttp.ClientSession(headers=ADMIN) as s:
            async with s.post(gw.url + "/v1/chat/completions", json=BODY) as r:
                assert r.status == 200
            async with s.get(gw.url + "/admin/usage") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "usage_disabled"
            async with s.get(gw.url + "/dashboard/usage") as r:
                assert r.status == 404
    finally:
        await gw.stop()
        await engine.stop()
