"""Dashboard end to end: routes on loopback, and a real browser reading numbers measured from real streams."""

from __future__ import annotations

import asyncio
import hmac
import os
import random
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.dashboard import COOKIE_NAME, setup_dashboard
from gateway.dashboard.session import issue_token
from tests.integration.browser import (
    Cookie,
    FormLogin,
    chromium_available,
    open_page,
    screenshot_and_read,
)

ADMIN_KEY = "sk-admin-4b1d9c0e7a2f5e8b3c6d"
USER_KEY = "sk-user-0f3a6c9e2b5d8a1c4e7b"
SECRET = b"dashboard-test-secret-0123456789"
SCREENSHOT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "dashboard.png"
WINDOW_S = 10.0
# class -> (output tokens, weight of each echo backend); the echo-down share makes real errors.
SHAPES = {
    "interactive": (6, (0.7, 0.2, 0.1)),
    "long_prompt": (12, (0.3, 0.6, 0.1)),
    "long_output": (40, (0.8, 0.15, 0.05)),
    "default": (16, (0.45, 0.45, 0.1)),
}


def admin_for_key(key: str) -> str | None:
    return "admin-1" if hmac.compare_digest(key.encode(), ADMIN_KEY.encode()) else None


@pytest.fixture
def chromium() -> None:
    """Skip on a workstation without Chromium; in CI its absence is a broken setup, so fail."""
    if chromium_available():
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI is set but /usr/bin/chromium is missing: apt-get install -y chromium")
    pytest.skip("/usr/bin/chromium is not installed (apt-get install -y chromium)")


def echo_engine(ttft_s: float, itl_s: float, rng: random.Random) -> web.Application:
    """An SSE server that streams `max_tokens` chunks with jittered first-token and inter-token delays."""

    async def chat(request: web.Request) -> web.StreamResponse:
        n = int(orjson.loads(await request.read())["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(ttft_s * rng.uniform(0.6, 1.6))
        for i in range(n):
            if i:
                await asyncio.sleep(itl_s * rng.uniform(0.5, 1.7))
            await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@dataclass
class Sample:
    t: float
    cls: str
    ok: bool
    ttft_ms: float | None
    itl_ms: list[float]
    e2e_ms: float
    tokens: int


@dataclass
class Meter:
    id: str
    engine: str
    url: str
    in_flight: int = 0
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=5000))


async def measure(http: aiohttp.ClientSession, meter: Meter, cls: str, n: int) -> bool:
    """One streamed request; TTFT and ITL are taken from the arrival of each SSE line."""
    meter.in_flight += 1
    start = last = time.monotonic()
    first: float | None = None
    itl: list[float] = []
    tokens = 0
    ok = False
    try:
        async with http.post(meter.url, data=orjson.dumps({"max_tokens": n, "stream": True})) as resp:
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                if first is None:
                    first = now
                else:
                    itl.append((now - last) * 1000)
                last, tokens = now, tokens + 1
            ok = resp.status == 200 and tokens == n
    except aiohttp.ClientError:
        ok = False
    finally:
        meter.in_flight -= 1
    ttft = None if first is None else (first - start) * 1000
    meter.samples.append(Sample(time.time(), cls, ok, ttft, itl, (time.monotonic() - start) * 1000, tokens))
    return ok


async def drive(meters: list[Meter], rng: random.Random, stop: asyncio.Event, deadline: float) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for _ in range(5000):  # bounded in count and in time
            if stop.is_set() or time.monotonic() > deadline:
                return
            cls = rng.choice(list(SHAPES))
            n, weights = SHAPES[cls]
            meter = rng.choices(meters, weights=weights)[0]
            if not await measure(http, meter, cls, n):
                await asyncio.sleep(0.1)


def pcts(values: list[float]) -> dict[str, float | None]:
    xs = sorted(values)
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": xs[min(len(xs) - 1, int(q / 100 * len(xs)))] for q in (50, 90, 99)}


def summarize(samples: list[Sample], span_s: float) -> dict[str, Any]:
    good = [s for s in samples if s.ok]
    return {
        "requests": len(samples),
        "rps": len(samples) / span_s,
        "error_rate": (len(samples) - len(good)) / len(samples) if samples else None,
        "output_tps": sum(s.tokens for s in samples) / span_s,
        "ttft_ms": pcts([s.ttft_ms for s in good if s.ttft_ms is not None]),
        "itl_ms": pcts([x for s in good for x in s.itl_ms]),
        "e2e_ms": pcts([s.e2e_ms for s in good]),
    }


def feed(meters: list[Meter], started: float) -> dict[str, Any]:
    """The dashboard feed shape, computed from the measured samples of the last WINDOW_S seconds."""
    now = time.time()
    span = max(0.5, min(WINDOW_S, now - started))
    recent = {m.id: [s for s in m.samples if s.t >= now - WINDOW_S] for m in meters}
    backends = []
    for m in meters:
        rows, tail = recent[m.id], list(m.samples)[-3:]
        overall = summarize(rows, span)
        health = "starting" if not tail else "unhealthy" if not any(s.ok for s in tail) else "ready"
        breaker = "open" if len(rows) >= 3 and (overall["error_rate"] or 0) >= 0.5 else "closed"
        backends.append({
            "id": m.id, "engine": m.engine, "health": health, "breaker": breaker, "in_flight": m.in_flight,
            "load": {"running": m.in_flight, "waiting": 0, "kv_usage": None, "idle_slots": None, "fresh": True},
            "overall": overall,
            "classes": {c: summarize([s for s in rows if s.cls == c], span) for c in SHAPES},
            "model": {"ttft_t0_ms": None, "prefill_tps": None, "itl_a_ms": None, "itl_b_ms": None,
                      "samples": len(m.samples)},
        })
    total = sum(len(r) for r in recent.values())
    classes = {}
    for c in SHAPES:
        per = {m.id: sum(1 for s in recent[m.id] if s.cls == c) for m in meters}
        classes[c] = {"requests": sum(per.values()), "share": sum(per.values()) / total if total else None,
                      "backends": per}
    errors = sum(1 for r in recent.values() for s in r if not s.ok)
    return {"now": now, "window_s": WINDOW_S, "backends": backends, "classes": classes,
            "totals": {"requests": total, "rps": total / span, "error_rate": errors / total if total else None,
                       "in_flight": sum(m.in_flight for m in meters)}}


@dataclass
class Live:
    url: str
    served: deque[dict[str, Any]]
    failing: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    rng = random.Random(7)
    engines = [TestServer(echo_engine(0.012, 0.003, rng), host="127.0.0.1"),
               TestServer(echo_engine(0.035, 0.008, rng), host="127.0.0.1")]
    for server in engines:
        await server.start_server()
    meters = [Meter("echo-fast", "vllm", str(engines[0].make_url("/v1/chat/completions"))),
              Meter("echo-slow", "sglang", str(engines[1].make_url("/v1/chat/completions"))),
              Meter("echo-down", "llamacpp", f"http://127.0.0.1:{free_port()}/v1/chat/completions")]
    started = time.time()
    state = Live(url="", served=deque(maxlen=300))

    async def provider() -> dict[str, Any]:
        if state.failing:
            raise RuntimeError("stats store unreachable")
        payload = feed(meters, started)
        state.served.append(payload)
        return payload

    app = web.Application()
    setup_dashboard(app, admin_for_key=admin_for_key, session_secret=SECRET, stats_provider=provider,
                    secure_cookie=False)
    dash = TestServer(app, host="127.0.0.1")
    await dash.start_server()
    state.url = str(dash.make_url("/dashboard"))
    stop = asyncio.Event()
    drivers = [asyncio.create_task(drive(meters, rng, stop, time.monotonic() + 60)) for _ in range(3)]
    try:
        yield state
    finally:
        stop.set()
        await asyncio.gather(*drivers)
        await dash.close()
        for server in engines:
            await server.close()


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


async def test_browser_shows_live_measured_numbers(chromium: None, live: Live) -> None:
    reading = await screenshot_and_read(live.url, FormLogin(ADMIN_KEY), SCREENSHOT, settle_s=5.0)
    first, second = reading.first, reading.second
    assert reading.page_errors == []
    assert second["stale"]["hidden"] is True
    for backend in ("echo-fast", "echo-slow"):
        for metric, path in (("ttft_p50", ("overall", "ttft_ms", "p50")), ("itl_p50", ("overall", "itl_ms", "p50"))):
            shown = float(second[f"{metric}:{backend}"]["value"])
            # What the page shows is exactly one of the payloads the feed served, not a made-up number.
            assert shown in served_values(live, path, backend)
            assert shown > 0
    # The faster engine is measured faster: the page carries real timings.
    assert float(second["ttft_p50:echo-fast"]["value"]) < float(second["ttft_p50:echo-slow"]["value"])
    assert second["health:echo-down"]["text"] == "unhealthy"
    assert second["breaker:echo-down"]["text"] == "open"
    assert second["health:echo-fast"]["text"] == "ready"
    # Live: the data timestamp and the measured numbers moved between the two reads.
    assert float(second["last-update"]["value"]) > float(first["last-update"]["value"])
    moving = [k for k in second if k.startswith(("ttft_p50:", "output_tps:", "rps:", "totals:"))
              and first.get(k, {}).get("value") != second[k]["value"]]
    assert moving, "no number changed between reads"
    assert float(second["route:long_output:echo-fast"]["value"]) > 0.5
    png = SCREENSHOT.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


async def test_browser_flags_a_failing_feed_as_stale(chromium: None, live: Live) -> None:
    token = issue_token("admin-1", SECRET, now=time.time(), ttl_s=600)
    async with open_page(width=1280, height=800) as page:
        await page.authenticate(live.url, Cookie(COOKIE_NAME, token))
        await page.wait_for("document.documentElement.dataset.feed === 'live'")
        live.failing = True
        await page.wait_for("document.documentElement.dataset.feed === 'stale'", timeout=5.0)
        banner = (await page.read())["stale"]
    assert banner["hidden"] is False
    assert "STALE" in banner["text"] and "503" in banner["text"]
