"""/metrics: each metric moves with the traffic that should move it (parsed, never string-searched)."""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
from collections import defaultdict

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.loopback import free_port, wait_http
from gateway.sim.runner import SimOptions, start_sim
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.procs import ROOT, to_toml, workers_ready

AUTH = {"Authorization": f"Bearer {USER_KEY}"}


class Scrape:
    """One /metrics scrape: sample name -> list of (labels, value)."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                self.samples[s.name].append((s.labels, s.value))

    def value(self, name: str, **labels: str) -> float:
        """Sum over the series whose labels include `labels` (0 when none)."""
        return sum(v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items()))

    def one(self, name: str, **labels: str) -> float:
        found = [v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items())]
        assert len(found) == 1, (name, labels, found)
        return found[0]


async def scrape(url: str, headers: dict | None = None) -> Scrape:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics", headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return Scrape(await r.text())


async def chat(s: aiohttp.ClientSession, url: str, *, stream: bool, n: int = 8, model: str = "m1",
               content: str = "hello", headers: dict | None = None) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": n, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with s.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={**AUTH, **(headers or {})}) as r:
        await r.read()
        return r.status


@pytest.fixture
async def two():
    engines = [await FakeEngine(Knobs()).start(), await FakeEngine(Knobs()).start()]
    gw = await start_gateway(gateway_config([
        {"id": "a", "engine": "vllm", "url": engines[0].url, "models": ["m1"]},
        {"id": "b", "engine": "llamacpp", "url": engines[1].url, "models": ["m1"]},
    ], routing={"policy": "round_robin"}, health={"breaker_failures": 2, "breaker_open_s": 30.0}))
    yield gw, engines
    await gw.stop()
    for e in engines:
        await e.stop()


async def test_request_latency_and_token_metrics_follow_traffic(two):
    gw, engines = two
    before = await scrape(gw.url)
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            assert await chat(s, gw.url, stream=True, n=8) == 200
        for _ in range(4):
            assert await chat(s, gw.url, stream=False, n=5) == 200
    m = await scrape(gw.url)

    def moved(name: str, **labels: str) -> float:
        return m.value(name, **labels) - before.value(name, **labels)

    assert moved("shapegate_requests_total", status="200", model="m1", **{"class": "default"}) == 10
    assert moved("shapegate_requests_total", backend="a") == 5 and moved("shapegate_requests_total", backend="b") == 5
    # Only streams have a first token and inter-token gaps; every request has an e2e and an overhead.
    assert moved("shapegate_ttft_seconds_count") == 6
    assert moved("shapegate_itl_seconds_count") == 6
    assert moved("shapegate_e2e_seconds_count") == 10
    assert moved("shapegate_gateway_overhead_seconds_count") == 10
    assert 0 < moved("shapegate_ttft_seconds_sum") < moved("shapegate_e2e_seconds_sum")
    assert moved("shapegate_ttft_seconds_bucket", le="+Inf") == 6
    assert moved("shapegate_prompt_tokens_total") == 10 * 10  # the fake engine reports 10 prompt tokens
    assert moved("shapegate_completion_tokens_total") == 6 * 8 + 4 * 5
    assert moved("shapegate_routing_decisions_total", policy="round_robin", reason="round_robin") == 10
    assert {lab["backend"] for lab, _ in m.samples["shapegate_routing_decisions_total"]} == {"a", "b"}
    assert m.one("shapegate_in_flight", backend="a") == 0
    assert m.one("shapegate_backend_health", backend="a", state="ready") == 1
    assert m.one("shapegate_backend_breaker", backend="b", state="closed") == 1
    assert m.one("shapegate_workers") == 1


async def test_in_flight_errors_breaker_and_health_move(two):
    gw, engines = two
    gate = engines[0].knobs.gate = asyncio.Event()
    engines[1].knobs.gate = gate
    async with aiohttp.ClientSession() as s:
        held = [asyncio.create_task(chat(s, gw.url, stream=True)) for _ in range(4)]
        while engines[0].knobs.active + engines[1].knobs.active < 4:
            await asyncio.sleep(0.01)
        m = await scrape(gw.url)
        assert m.value("shapegate_in_flight") == 4
        assert m.one("shapegate_in_flight", backend="a", engine="vllm") == 2
        gate.set()
        assert await asyncio.gather(*held) == [200] * 4
        assert (await scrape(gw.url)).value("shapegate_in_flight") == 0

        engines[1].knobs.fail_status = 400  # the request's fault: relayed, never retried, not the engine's
        engines[0].knobs.fail_status = 503
        engines[0].knobs.retry_after = "30"
        statuses = [await chat(s, gw.url, stream=False) for _ in range(3)]
    m = await scrape(gw.url)
    assert m.value("shapegate_upstream_client_errors_total", backend="b", status="400") >= 1
    assert m.value("shapegate_requests_total", backend="a", status="503") >= 1
    assert m.one("shapegate_backend_breaker", backend="a", state="open") == 1
    assert m.value("shapegate_upstream_retries_total", backend="a") >= 1
    assert 400 in statuses

    await engines[1].stop()  # probes fail: b turns unhealthy
    for _ in range(100):
        m = await scrape(gw.url)
        if m.one("shapegate_backend_health", backend="b", state="unhealthy") == 1:
            break
        await asyncio.sleep(0.05)
    assert m.one("shapegate_backend_health", backend="b", state="ready") == 0
    assert m.value("shapegate_backend_health_changes_total", backend="b", state="unhealthy") == 1
    async with aiohttp.ClientSession() as s:
        assert await chat(s, gw.url, stream=False) == 503  # a is held open, b is down
    assert (await scrape(gw.url)).value("shapegate_rejected_total", status="503") >= 1


async def test_engine_load_and_prefix_affinity():
    sim = await start_sim(SimOptions(engine="vllm", model="m1"))
    engine = await FakeEngine(Knobs()).start()
    gw = await start_gateway(gateway_config([
        {"id": "sim", "engine": "vllm", "url": sim.url, "models": ["m1"]},
        {"id": "fake", "engine": "openai", "url": engine.url, "models": ["m1"]},
    ], routing={"policy": "prefix_affinity"}, health={"load_interval_s": 0.05}))
    try:
        prompt = "You are a careful assistant. " * 40  # several prefix blocks
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                assert await chat(s, gw.url, stream=True, content=prompt) == 200
        m = await scrape(gw.url)
        assert m.one("shapegate_prefix_affinity_total", result="miss") == 1
        assert m.one("shapegate_prefix_affinity_total", result="hit") == 2
        decisions = {lab["reason"]: v for lab, v in m.samples["shapegate_routing_decisions_total"]}
        assert sum(decisions.values()) == 3 and decisions.get("prefix") == 2
        for _ in range(60):  # the load loop scrapes the engine's own /metrics
            m = await scrape(gw.url)
            if m.samples.get("shapegate_engine_kv_usage"):
                break
            await asyncio.sleep(0.05)
        assert m.one("shapegate_engine_running", backend="sim") == 0
        assert m.one("shapegate_engine_waiting", backend="sim") == 0
        assert 0 <= m.one("shapegate_engine_kv_usage", backend="sim") <= 1
        assert m.one("shapegate_engine_load_age_seconds", backend="sim") < 3
        assert not [lab for lab, _ in m.samples["shapegate_engine_running"] if lab["backend"] == "fake"]
    finally:
        await gw.stop()
        await engine.stop()
        await sim.close()


async def test_stats_off_keeps_counters_and_drops_histograms():
    engine = await FakeEngine(Knobs()).start()
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}],
                                            stats={"enabled": False}))
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                assert await chat(s, gw.url, stream=True) == 200
            async with s.get(gw.url + "/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                feed = await r.json()
        m = await scrape(gw.url)
        assert m.value("shapegate_requests_total", status="200") == 3
        assert m.value("shapegate_completion_tokens_total") == 3 * 8
        assert m.value("shapegate_routing_decisions_total") == 3
        for h in ("shapegate_ttft_seconds", "shapegate_itl_seconds", "shapegate_e2e_seconds"):
            assert m.value(h + "_count") == 0
        assert m.value("shapegate_gateway_overhead_seconds_count") == 0
        assert feed["enabled"] is False and feed["totals"]["requests"] == 0
        assert gw.state.pool.get("a").latency.samples == 0
    finally:
        await gw.stop()
        await engine.stop()


async def test_metrics_access_is_configurable():
    engine = await FakeEngine(Knobs()).start()
    backends = [{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}]
    locked = await start_gateway(gateway_config(backends, metrics={"require_admin": True}))
    off = await start_gateway(gateway_config(backends, metrics={"enabled": False}))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(locked.url + "/metrics") as r:
                assert r.status == 401
            async with s.get(locked.url + "/metrics", headers=AUTH) as r:
                assert r.status == 403
            async with s.get(off.url + "/metrics") as r:
                assert r.status == 404
        m = await scrape(locked.url, {"Authorization": f"Bearer {ADMIN_KEY}"})
        assert m.one("shapegate_backend_health", backend="a", state="ready") == 1
        assert not math.isnan(m.one("shapegate_in_flight", backend="a"))
    finally:
        await locked.stop()
        await off.stop()
        await engine.stop()


async def test_two_workers_add_up_in_one_scrape(tmp_path):
    """`serve --workers 2`: any worker's /metrics counts the requests both served."""
    engine = await FakeEngine(Knobs()).start()
    port = free_port()
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}],
                         server={"access_log": True})
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        "--workers", "2", cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    out = asyncio.create_task(proc.stdout.read())
    try:
        await wait_http(url + "/readyz", 20.0)
        ready = await workers_ready(url, 2, 10.0)  # their request-id prefixes
        ids = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for _ in range(40):
                async with s.post(url + "/v1/chat/completions", headers=AUTH, json={
                        "model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}) as r:
                    assert r.status == 200
                    ids.append(r.headers["x-request-id"])
        assert {i[:12] for i in ids} == ready  # both served some
        # Each worker copies its counts and pool view (in-flight) to its files every 0.2 s: until both have.
        deadline = time.monotonic() + 5
        while True:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.get(url + "/metrics") as r:
                    m = Scrape(await r.text())
            if m.one("shapegate_in_flight", backend="a") == 0 and m.value("shapegate_e2e_seconds_count") == 40:
                break
            assert time.monotonic() < deadline, "the workers' counts never added up to the requests served"
            await asyncio.sleep(0.05)
        for _ in range(6):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.get(url + "/metrics") as r:
                    m = Scrape(await r.text())
            assert m.value("shapegate_requests_total", backend="a", status="200") == 40
            assert m.value("shapegate_requests_total", backend="a", outcome="ok") == 40
            assert m.value("shapegate_e2e_seconds_count") == 40
            assert m.value("shapegate_completion_tokens_total") == 40 * 3
            assert m.one("shapegate_workers") == 2
            assert m.one("shapegate_backend_health", backend="a", state="ready") == 1
            assert m.one("shapegate_in_flight", backend="a") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        await engine.stop()
    lines = [orjson.loads(x) for x in (await out).splitlines()]  # every line whole, none interleaved
    assert sorted(x["request_id"] for x in lines if x["status"] == 200) == sorted(ids)
