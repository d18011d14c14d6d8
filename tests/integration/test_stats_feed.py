"""/stats: admin only, and its rolling figures agree with what a client measured on the same streams."""

from __future__ import annotations

import statistics
import time

import aiohttp
import orjson
import pytest

from gateway.contracts import ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.stats.merge import render
from gateway.stats.rolling import BackendStats
from gateway.stats.sketch import REL_ERR
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway

DELAY_S = 0.015  # the fake engine sleeps this long before every token
TOKENS = 5
# Both sides read the same monotonic clock; the client's span also holds the gateway's own work
# (parse, route, relay) and the loopback hops, which stay well under this on an idle loop.
TOLERANCE_MS = 4.0


async def stream_and_time(s: aiohttp.ClientSession, url: str, headers: dict | None = None) -> dict:
    """One stream; TTFT, ITL and e2e as the client saw them, from the arrival of each content chunk."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "stream": True}
    t0 = time.monotonic()
    times = []
    async with s.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                      headers={"Authorization": f"Bearer {USER_KEY}", **(headers or {})}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":"w' in line:
                times.append(time.monotonic())
    end = time.monotonic()
    assert len(times) == TOKENS
    return {"ttft": (times[0] - t0) * 1000, "itl": (times[-1] - times[0]) / (TOKENS - 1) * 1000,
            "e2e": (end - t0) * 1000}


async def get_stats(url: str, key: str | None = ADMIN_KEY) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with s.get(url + "/stats", headers=headers) as r:
            assert r.content_type == "application/json"
            return r.status, orjson.loads(await r.read())


@pytest.fixture
async def setup():
    engine = await FakeEngine(Knobs(chunk_delay=DELAY_S)).start()
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}],
                                            stats={"window_s": 30.0, "warmup_samples": 0}))
    yield gw, engine
    await gw.stop()
    await engine.stop()


async def test_stats_needs_an_admin_key(setup):
    gw, _ = setup
    assert (await get_stats(gw.url, None))[0] == 401
    assert (await get_stats(gw.url, USER_KEY))[0] == 403
    status, feed = await get_stats(gw.url)
    assert status == 200 and feed["window_s"] == 30.0 and feed["backends"][0]["overall"]["requests"] == 0


async def test_stats_match_the_client_measurements(setup):
    gw, engine = setup
    measured = {"default": [], "interactive": []}
    async with aiohttp.ClientSession() as s:
        for i in range(16):
            if i % 4 == 3:  # a session stream with short output: the interactive class
                measured["interactive"].append(await stream_and_time(s, gw.url, {"x-session-id": f"s{i}"}))
            else:
                measured["default"].append(await stream_and_time(s, gw.url))
        engine.knobs.fail_status = 500
        for _ in range(4):
            async with s.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {USER_KEY}"},
                              json={"model": "m1", "messages": [{"role": "user", "content": "x"}]}) as r:
                assert r.status >= 500
    _, feed = await get_stats(gw.url)
    (b,) = feed["backends"]
    o = b["overall"]
    assert (b["id"], b["engine"], b["health"], b["breaker"], b["in_flight"]) == ("a", "vllm", "ready", "closed", 0)
    assert o["requests"] == 20 and o["error_rate"] == pytest.approx(4 / 20)
    assert o["outcomes"] == {"ok": 16, "client_left": 0, "client_error": 0, "engine_error": 4}
    assert o["output_tps"] / o["rps"] == pytest.approx(16 * TOKENS / 20)  # same span: tokens per request
    assert feed["totals"]["requests"] == 20 and feed["totals"]["in_flight"] == 0
    assert {k: v["requests"] for k, v in feed["classes"].items()} == {"default": 16, "interactive": 4}
    assert feed["classes"]["interactive"]["backends"] == {"a": 4}
    assert feed["classes"]["interactive"]["share"] == pytest.approx(4 / 20)
    everything = measured["default"] + measured["interactive"]
    for cls, rows, got in (("overall", everything, o),
                           ("interactive", measured["interactive"], b["classes"]["interactive"])):
        for key in ("ttft", "itl", "e2e"):
            client = statistics.median_low([m[key] for m in rows])
            gateway = got[f"{key}_ms"]["p50"]
            # The gateway times a sub-interval of what the client times, from the same clock.
            assert gateway - 1.0 <= client <= gateway + TOLERANCE_MS, (cls, key, client, gateway)
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert got[key]["p50"] <= got[key]["p90"] <= got[key]["p99"]
    assert o["ttft_ms"]["p50"] >= DELAY_S * 1000 and o["itl_ms"]["p50"] >= DELAY_S * 1000
    # The latency model has learned from the same streams; its predictions sit near what was measured.
    assert b["model"]["samples"] >= 10
    assert 0.5 < o["predicted"]["ttft_ms"] / o["ttft_ms"]["p50"] < 2
    assert 0.5 < o["predicted"]["itl_ms"] / o["itl_ms"]["p50"] < 2


def overall(stats: BackendStats, now: float, window_s: float) -> dict:
    """One backend's figures over all classes, through the same merge /stats uses."""
    entry = {"engine": "vllm", "health": "ready", "breaker": "closed", "in_flight": 0, "load": None,
             "fit": {"ttft_t0": 0.01, "prefill_rate": 1e4, "itl_a": 0.005, "itl_b": 0.0, "samples": 0,
                     "ttft_per_running": 0.0, "service_s": 1.0},
             "failovers": 0, "breaker_openings": 0, **stats.summary(now, window_s)}
    summary = {"worker": "1", "taken_at": 0.0, "window_s": window_s, "enabled": True, "backends": {"a": entry}}
    (row,) = render([summary], 0.0)["backends"]
    return row["overall"]


def test_rates_count_every_request_beyond_the_sample_cap():
    stats = BackendStats(max_samples=64, now=0.0)
    shape = RequestShape(model="m", route="chat", stream=True, prompt_tokens=10, output_tokens=4, klass="default")
    for i in range(5000):  # 500 requests/s for 10 s; one in ten fails
        ok = i % 10 != 0
        stats.add(Outcome("a", shape, ok=ok, status=200 if ok else 500, ttft=0.01 + (i % 100) / 10_000, itl=0.002,
                          e2e=0.05, prompt_tokens=10, completion_tokens=4, result=OK if ok else ENGINE_ERROR),
                  now=100.0 + i / 500)
    rep = overall(stats, now=110.0, window_s=30.0)
    assert rep["samples"] == 64 and rep["requests"] == 5000
    assert rep["rps"] == pytest.approx(5000 / 30) and rep["error_rate"] == pytest.approx(0.1)
    assert rep["outcomes"] == {"ok": 4500, "client_left": 0, "client_error": 0, "engine_error": 500}
    assert rep["output_tps"] == pytest.approx(5000 * 4 / 30)
    # Percentiles of the 58 served among the last 64 samples (TTFT 13.6-19.9 ms), within the sketch's error.
    assert rep["ttft_ms"]["p50"] == pytest.approx(16.7, rel=REL_ERR)
    assert rep["ttft_ms"]["p99"] == pytest.approx(19.9, rel=REL_ERR)
    young = BackendStats(max_samples=64, now=100.0)  # the window has not filled yet: rates over the time seen
    young.add(Outcome("a", shape, ok=True, status=200, e2e=0.1, completion_tokens=8), now=101.0)
    assert overall(young, now=104.0, window_s=30.0)["rps"] == pytest.approx(1 / 4)
    assert overall(stats, now=200.0, window_s=30.0)["requests"] == 0
