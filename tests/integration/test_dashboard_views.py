"""The dashboard in a real browser: every table fits its panel from laptop to desktop widths, the charts open filled
from the gateway's history, and the keys view lists each key with its usage (never a key or a digest)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.keys.principal import hash_key
from gateway.sim.runner import SimOptions, SimServer, start_sim
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway
from tests.integration.browser import FormLogin, Page, open_page

pytestmark = pytest.mark.usefixtures("chromium")  # tests/integration/conftest.py: fails in CI without it

SIZES = ((1280, 800), (1440, 900), (1920, 1080))
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REQUESTS = 12  # by the configured key "user", half to each model
# Everything on the page is laid out: the page never scrolls sideways, no panel has to scroll to show its table,
# and nothing ends right of the viewport.
FIT_JS = """(() => {
  const page = document.documentElement, vw = page.clientWidth, problems = [];
  const right = (e) => e.getBoundingClientRect().right;
  if (page.scrollWidth > vw) problems.push(`page scrolls sideways to ${page.scrollWidth}`);
  for (const t of document.querySelectorAll('main table')) {
    const panel = t.closest('.panel');
    if (!t.getClientRects().length) continue;  // in a hidden section
    if (panel.scrollWidth > panel.clientWidth || right(t) > right(panel) + 0.5)
      problems.push(`${panel.className}: table ${t.scrollWidth} px in a panel of ${panel.clientWidth} px`);
  }
  for (const e of document.querySelectorAll('body *')) {
    const r = e.getBoundingClientRect();
    if (r.width && r.right > vw + 0.5) problems.push(`${e.tagName.toLowerCase()}.${e.className} ends at ${r.right}`);
  }
  for (const c of document.querySelectorAll('.chart canvas'))
    if (!(c.clientWidth > 100 && c.clientHeight > 80)) problems.push(`a chart of ${c.clientWidth}x${c.clientHeight}`);
  return problems.slice(0, 20);
})()"""
KEYS_SHOWN = "document.querySelector('[data-testid=\"key-requests:user\"]')?.dataset.value > 0"
EXPERIMENTS_SHOWN = ("document.querySelector('[data-testid=\"experiments\"]').hidden === false && "
                     "document.querySelector('[data-testid=\"arm:sh:candidate\"]') !== null")


@dataclass
class Stack:
    gw: RunningGateway
    tight_key: str = ""  # a run-time key with a limit of 2 requests a minute
    prompt_tokens: int = 0  # as the replies to "user" reported them
    completion_tokens: int = 0
    served: dict[str, int] = field(default_factory=dict)  # key id -> requests served

    @property
    def url(self) -> str:
        return self.gw.url + "/dashboard"


def views_config(sims: list[SimServer]) -> dict:
    """Three simulated engines; a split experiment on m1 and a shadow one on m2 (its widest table)."""
    vllm, sglang, llama = sims
    backends = [{"id": "vllm-1", "engine": "vllm", "url": vllm.url, "models": {"m1": vllm.model, "m2": vllm.model}},
                {"id": "sglang-1", "engine": "sglang", "url": sglang.url, "models": {"m1": sglang.model}},
                {"id": "llama-1", "engine": "llamacpp", "url": llama.url, "models": {"m2": llama.model}}]
    return gateway_config(backends) | {"experiments": [
        {"name": "ab", "model": "m1", "mode": "split", "subject": "user",
         "arms": [{"name": "a", "backends": ["vllm-1"]}, {"name": "b", "backends": ["sglang-1"]}]},
        {"name": "sh", "model": "m2", "mode": "shadow", "subject": "user", "shadow_max_in_flight": 20,
         "arms": [{"name": "candidate", "backends": ["llama-1"]}]}]}


async def traffic(stack: Stack) -> None:
    """REQUESTS by "user" (usage summed as the client saw it), then three by the tight key: the third refused."""
    async with openai.AsyncOpenAI(base_url=stack.gw.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
        async def one(i: int) -> None:  # streamed: the charts' latencies are measured on streams
            stream = await client.chat.completions.create(
                model=f"m{1 + i % 2}", max_tokens=24, user=f"u{i}", stream=True,
                stream_options={"include_usage": True}, messages=[{"role": "user", "content": f"hello number {i}"}])
            async for chunk in stream:
                if chunk.usage is not None:
                    stack.prompt_tokens += chunk.usage.prompt_tokens
                    stack.completion_tokens += chunk.usage.completion_tokens

        for start in range(0, REQUESTS, 4):
            await asyncio.gather(*(one(i) for i in range(start, start + 4)))
    async with openai.AsyncOpenAI(base_url=stack.gw.url + "/v1", api_key=stack.tight_key, max_retries=0) as client:
        for _ in range(2):
            await client.chat.completions.create(model="m1", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m1", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    sims = [await start_sim(SimOptions(engine=engine, seed=seed))
            for seed, engine in enumerate(("vllm", "sglang", "llamacpp"), 1)]
    gw = await start_gateway(views_config(sims))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/admin/keys", headers=ADMIN,
                              json={"id": "tight", "limits": {"rpm": 2}}) as r:
                assert r.status == 201
                tight = (await r.json())["key"]
        stack = Stack(gw, tight)
        await traffic(stack)
        yield stack
    finally:
        await gw.stop()
        for sim in sims:
            await sim.close()


async def history_points(gw: RunningGateway) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/dashboard/history", headers=ADMIN) as r:
            assert r.status == 200
            return await r.json()


async def signed_in(page: Page, stack: Stack, ready: str) -> None:
    await page.authenticate(stack.url, FormLogin(ADMIN_KEY))
    await page.wait_for(ready, timeout=15.0)


async def test_every_table_fits_its_panel_from_1280_to_1920_wide(stack: Stack, tmp_path: Path) -> None:
    async with open_page(width=1280, height=800) as page:
        await signed_in(page, stack, f"{KEYS_SHOWN} && {EXPERIMENTS_SHOWN} && "
                                     "document.documentElement.dataset.feed === 'live'")
        for width, height in SIZES:
            await page.resize(width, height)
            await asyncio.sleep(0.3)  # a layout and a chart redraw at the new size
            problems = await page.evaluate(FIT_JS)
            shot = tmp_path / f"dashboard-{width}x{height}.png"
            await page.screenshot(shot)
            # The lower half too (experiments, keys), for a person reading the screenshots.
            await page.evaluate("document.querySelector('[data-testid=\"experiments\"]').scrollIntoView(); true")
            await page.screenshot(tmp_path / f"dashboard-{width}x{height}-lower.png")
            await page.evaluate("window.scrollTo(0, 0); true")
            assert problems == [], (width, height, problems)
            assert shot.read_bytes().startswith(b"\x89PNG")
        # Every column of the backends table is on screen at the smallest size, e2e last.
        await page.resize(1280, 800)
        await asyncio.sleep(0.3)
        boxes = await page.boxes()
        errors = list(page.errors)
    assert errors == []
    e2e = boxes["table:e2e_p99:vllm-1"]
    assert e2e["width"] > 0 and e2e["x"] + e2e["width"] <= 1280 - 16


async def test_charts_open_filled_from_the_gateways_history(stack: Stack) -> None:
    for _ in range(100):  # the gateway samples its feed once a second: a few points with latencies in them
        history = await history_points(stack.gw)
        if sum(v is not None for v in history["backends"]["vllm-1"]["ttft_p50"]) >= 5:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"the gateway's history never had 5 points of TTFT: {history}")
    assert history["scope"] == "group" and history["interval_s"] == 1.0
    async with open_page(width=1280, height=800) as page:
        await page.authenticate(stack.url, FormLogin(ADMIN_KEY))
        # As soon as the history came, before the page has polled the feed more than a time or two.
        await page.wait_for("document.querySelector('[data-testid=\"charts\"]').dataset.history > 0")
        charts = await page.evaluate("""(() => {
          const root = document.querySelector('[data-testid="charts"]');
          return {history: +root.dataset.history, from: +root.dataset.historyFrom,
                  points: Object.fromEntries(Array.from(root.querySelectorAll('.chart'),
                                                        c => [c.dataset.testid, +(c.dataset.points ?? 0)]))};
        })()""")
        errors = list(page.errors)
    assert errors == []
    assert charts["history"] >= len(history["t"]) >= 5
    assert charts["from"] == history["t"][0]  # the gateway's own points, from its first
    assert len(charts["points"]) == 8
    for chart, points in charts["points"].items():
        assert points >= 5, (chart, points)


async def test_the_keys_view_lists_each_key_with_its_usage(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:  # admin only, like the rest of the dashboard
        for headers in ({}, {"Authorization": f"Bearer {USER_KEY}"}):
            for path in ("/dashboard/keys", "/dashboard/history"):
                async with s.get(stack.gw.url + path, headers=headers) as r:
                    assert r.status == 401, (path, headers)
    async with open_page(width=1920, height=1080) as page:
        await signed_in(page, stack, KEYS_SHOWN)
        dom = await page.read()
        html = await page.evaluate("document.documentElement.outerHTML")
        errors = list(page.errors)
    assert errors == []
    value = lambda testid: int(dom[testid]["value"])  # noqa: E731
    # "user": every request served once (no failover among healthy engines), tokens as its replies reported them.
    assert value("key-requests:user") == REQUESTS and value("key-refused:user") == 0
    assert value("key-prompt:user") == stack.prompt_tokens > 0
    assert value("key-output:user") == stack.completion_tokens > 0
    assert dom["key-source:user"]["text"] == "config file" and dom["key-admin:user"]["text"] == "—"
    assert dom["key-limits:user"]["text"] == "none"
    # The run-time key: two served, the third refused by its limit of 2 a minute.
    assert (value("key-requests:tight"), value("key-refused:tight")) == (2, 1)
    assert dom["key-limits:tight"]["text"] == "2 req/min" and dom["key-source:tight"]["text"] == "run-time"
    assert float(dom["key-last-used:tight"]["value"]) > 0 and "ago" in dom["key-last-used:tight"]["text"]
    # The admin who signed in: no traffic of its own.
    assert dom["key-admin:ops"]["text"] == "admin" and value("key-requests:ops") == 0
    # Busiest first.
    order = [k.split(":", 1)[1] for k in dom if k.startswith("key:")]
    assert order == ["user", "tight", "ops"]
    assert "usage in the last 60 s (this process)" in dom["keys-scope"]["text"]
    for secret in (USER_KEY, ADMIN_KEY, stack.tight_key):
        assert secret not in html and hash_key(secret) not in html
    # Revoked, the key's usage stays for the window, under its id, as no key's.
    async with aiohttp.ClientSession(headers=ADMIN) as s:
        async with s.delete(stack.gw.url + "/admin/keys/tight") as r:
            assert r.status == 200
        async with s.get(stack.gw.url + "/dashboard/keys") as r:
            report = await r.json()
    rows = {k["id"]: k for k in report["keys"]}
    assert rows["tight"]["source"] == "unlisted" and rows["tight"]["usage"]["requests"] == 2
    assert (report["scope"], report["workers"], report["total"]) == ("group", 1, 3)
