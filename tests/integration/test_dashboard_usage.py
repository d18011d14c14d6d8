"""The dashboard's usage view in a real browser: the ledger's figures by day and by key, costs, the days switch."""

from __future__ import annotations

import aiohttp

from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.integration.browser import FormLogin, open_page

USAGE_SHOWN = """document.querySelector('[data-testid="usage-requests:user"]') !== null"""


async def test_the_usage_view_shows_the_ledger(chromium: None, tmp_path) -> None:
    engine = await FakeEngine(Knobs(stream_chunks=4)).start()
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engine.url, "models": ["m"]}],
                         usage={"flush_interval_s": 0.05, "currency": "EUR",
                                "prices": {"m": {"input_per_million": 2e5, "output_per_million": 1e6}}})
    gw = await start_gateway(cfg)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"}) as s:
            for _ in range(3):
                async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
        await kit.until(lambda: len(gw.state.ledger) == 0 and not gw.state.usage.waiting, "the rows flushed")
        async with open_page(width=1440, height=1400) as page:
            await page.authenticate(gw.url + "/dashboard", FormLogin(ADMIN_KEY))
            await page.wait_for(USAGE_SHOWN, timeout=15.0)
            seen = await page.read()
            assert seen["usage-requests:user"]["value"] == "3"
            assert seen["usage-output:user"]["value"] == "12"  # the fake engine's 4 tokens, three times
            assert float(seen["usage-cost:user"]["value"]) > 0 and seen["usage-cost:user"]["text"].endswith("EUR")
            assert seen["usage-requests:total"]["value"] == "3"
            assert "last 7 days" in seen["usage-scope"]["text"] and "this process only" in seen["usage-scope"]["text"]
            await page.evaluate("document.querySelector('[data-usage-days=\"30\"]').click(); true")
            await page.wait_for("""document.querySelector('[data-testid="usage-scope"]').textContent
                                   .includes('last 30 days')""")
            await page.screenshot(tmp_path / "usage.png")
            assert [e for e in page.errors] == []
    finally:
        await gw.stop()
        await engine.stop()
    assert (tmp_path / "usage.png").read_bytes().startswith(b"\x89PNG")
