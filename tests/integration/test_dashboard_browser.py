"""Dashboard end to end: a real browser on a real gateway in front of simulated engines under live traffic, and
the sign-in page's layout."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

import gateway.app
from benchmarks.loopback import free_port
from gateway.sim.faults import FaultSpec
from gateway.sim.runner import SimOptions, SimServer, start_sim
from tests.fake_engine import FakeEngine
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway
from tests.integration.browser import FormLogin, open_page, screenshot_and_read

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SCREENSHOT = RESULTS / "dashboard.png"
LOGIN_SCREENSHOT = RESULTS / "login.png"
BACKENDS = ("vllm-1", "sglang-1", "llama-1")
LONG_PROMPT = "Summarise the following report section by section, keeping every figure. " * 60
# class -> (prompt, max output tokens, session header?)
SHAPES = {
    "interactive": ("hi, quick question", 24, True),
    "long_prompt": (LONG_PROMPT, 48, False),
    "long_output": ("write a long story", 640, False),
    "default": ("hello there", 96, False),
}


@dataclass
class Live:
    gw: RunningGateway
    served: list[dict[str, Any]] = field(default_factory=list)  # every feed payload the gateway produced
    client_ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    sent: int = 0
    failing: bool = False

    @property
    def url(self) -> str:
        return self.gw.url + "/dashboard"


async def drive(live: Live, rng: random.Random, stop: asyncio.Event) -> None:
    """Streams of every class through the gateway with the official client, TTFT timed per backend."""
    async with openai.AsyncOpenAI(base_url=live.gw.url + "/v1", api_key=USER_KEY, max_retries=0,
                                  timeout=20.0) as client:
        while not stop.is_set():
            cls = rng.choice(list(SHAPES))
            prompt, n, session = SHAPES[cls]
            headers = {"x-session-id": f"s{rng.getrandbits(40)}"} if session else {}
            t0 = time.monotonic()
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="m1", messages=[{"role": "user", "content": prompt}], max_tokens=n, stream=True,
                    extra_headers=headers)
                first = None
                async for chunk in raw.parse():
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.monotonic() - t0
                if first is not None:
                    live.client_ttft[raw.headers["x-shapegate-backend"]].append(first * 1000)
            except openai.APIError:
                await asyncio.sleep(0.05)  # an injected engine error; the dashboard counts it
            live.sent += 1


@pytest.fixture
async def live(monkeypatch) -> AsyncIterator[Live]:
    sims: list[SimServer] = [
        await start_sim(SimOptions(engine="vllm", seed=1)),
        await start_sim(SimOptions(engine="sglang", seed=2, faults=FaultSpec(error_rate=0.04))),
        await start_sim(SimOptions(engine="llamacpp", seed=3)),
    ]
    backends = [{"id": bid, "engine": sim.engine, "url": sim.url, "models": {"m1": sim.model}}
                for bid, sim in zip(BACKENDS, sims)]
    backends[2]["interactive"] = True
    backends.append({"id": "llama-down", "engine": "llamacpp", "url": f"http://127.0.0.1:{free_port()}",
                     "models": ["m1"]})
    gw = await start_gateway(gateway_config(backends, routing={"policy": "shape"}, stats={"window_s": 10.0}))
    state = Live(gw)

    def recording(g):
        if state.failing:
            raise RuntimeError("stats unavailable")
        payload = feed(g)
        state.served.append(payload)
        return payload

    feed = gateway.app.stats_report
    monkeypatch.setattr(gateway.app, "stats_report", recording)  # what the dashboard's feed calls
    stop = asyncio.Event()
    rng = random.Random(7)
    drivers = [asyncio.create_task(drive(state, rng, stop)) for _ in range(4)]
    try:
        yield state
    finally:
        stop.set()
        await asyncio.gather(*drivers)
        await gw.stop()
        for sim in sims:
            await sim.close()


def served_values(live: Live, path: tuple[str, ...], backend: str) -> set[float]:
    out = set()
    for payload in live.served:
        for b in payload["backends"]:
            if b["id"] == backend:
                v: Any = b
                for key in path:
                    v = v[key]
                if v is not None:
                    out.add(v)
    return out


async def test_browser_shows_live_gateway_numbers(chromium: None, live: Live) -> None:
    reading = await screenshot_and_read(live.url, FormLogin(ADMIN_KEY), SCREENSHOT, settle_s=4.0,
                                        width=1440, height=1000)
    first, second = reading.first, reading.second
    assert reading.page_errors == []
    assert second["stale"]["hidden"] is True
    assert live.sent > 40
    for backend in BACKENDS:
        assert second[f"health:{backend}"]["text"] == "ready"
        for metric, path in (("ttft_p50", ("overall", "ttft_ms", "p50")), ("itl_p50", ("overall", "itl_ms", "p50")),
                             ("output_tps", ("overall", "output_tps"))):
            shown = float(second[f"{metric}:{backend}"]["value"])
            # Exactly one of the payloads the gateway's feed served, not a made-up number.
            assert shown in served_values(live, path, backend), (metric, backend)
            assert shown > 0
        # The gateway times a sub-interval of what the client timed on the same streams.
        assert float(second[f"ttft_p50:{backend}"]["value"]) <= max(live.client_ttft[backend])
    assert second["health:llama-down"]["text"] in ("starting", "unhealthy")  # never answered a probe
    assert float(second["table:error_rate:sglang-1"]["value"]) > 0
    # Live: the data timestamp and measured numbers moved between the two reads.
    assert float(second["last-update"]["value"]) > float(first["last-update"]["value"])
    moving = [k for k in second if k.startswith(("ttft_p50:", "output_tps:", "rps:", "totals:"))
              and first.get(k, {}).get("value") != second[k]["value"]]
    assert moving, "no number changed between reads"
    for cls in SHAPES:  # every class of the traffic mix shows up in the routing table
        assert int(float(second[f"route:{cls}:requests"]["value"])) > 0
        shares = [float(second[f"route:{cls}:{b}"]["value"] or 0) for b in (*BACKENDS, "llama-down")]
        assert sum(shares) == pytest.approx(1.0)
    png = SCREENSHOT.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


async def test_browser_flags_a_failing_feed_as_stale(chromium: None, live: Live) -> None:
    async with open_page(width=1280, height=800) as page:
        await page.authenticate(live.url, FormLogin(ADMIN_KEY))
        await page.wait_for("document.documentElement.dataset.feed === 'live'")
        live.failing = True
        await page.wait_for("document.documentElement.dataset.feed === 'stale'", timeout=5.0)
        banner = (await page.read())["stale"]
    assert banner["hidden"] is False
    assert "STALE" in banner["text"] and "503" in banner["text"]


# Loaded with its stylesheet: boxes measured before the CSS applies would be the unstyled page's.
SIGNED_OUT_PAGE = "document.readyState === 'complete' && document.querySelector('[data-testid=\"{}\"]') !== null"


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


def check_sign_in_layout(boxes: dict[str, dict[str, float]], viewport_width: int) -> None:
    """Title, notice and form stacked without overlapping; a key field and button wide enough to use."""
    title, form, key, submit = (boxes[k] for k in ("login-title", "login-form", "login-key", "login-submit"))
    assert title["width"] >= 150 and key["width"] >= 200 and key["height"] >= 24, (title, key)
    assert submit["width"] >= 80, submit
    stacked = [title, *([boxes["login-error"]] if "login-error" in boxes else []), form]
    for upper, lower in zip(stacked, stacked[1:]):
        assert not overlap(upper, lower) and upper["y"] + upper["height"] <= lower["y"], (upper, lower)
    for part in (key, submit):  # inside the form, inside the viewport
        assert form["x"] <= part["x"] and part["x"] + part["width"] <= form["x"] + form["width"] + 0.5
        assert 0 <= part["x"] and part["x"] + part["width"] <= viewport_width


async def test_sign_in_page_is_laid_out_and_says_why_a_key_failed(chromium: None) -> None:
    engine = await FakeEngine().start()
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m"]}]))
    try:
        async with open_page(width=1280, height=800) as page:
            await page.navigate(gw.url + "/dashboard")
            await page.wait_for(SIGNED_OUT_PAGE.format("login-key"))
            check_sign_in_layout(await page.boxes(), 1280)
            assert page.errors == []
            await page.screenshot(LOGIN_SCREENSHOT)
            # A key that is not an admin's: the same page again, with the reason above the form.
            await page.evaluate(f"document.querySelector('[data-testid=\"login-key\"]').value = "
                                f"{USER_KEY!r}; document.querySelector('form').submit(); true")
            await page.wait_for(SIGNED_OUT_PAGE.format("login-error"))
            boxes = await page.boxes()
            assert "not an admin key" in (await page.read())["login-error"]["text"]
            check_sign_in_layout(boxes, 1280)
            await page.resize(360, 640)  # a phone: the card narrows, the field stays usable
            check_sign_in_layout(await page.boxes(), 360)
            assert [e for e in page.errors if "401" not in e] == []  # the refused key's own 401 only
    finally:
        await gw.stop()
        await engine.stop()
    png = LOGIN_SCREENSHOT.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5_000
